//! docs/operating.md's tables, generated: the flags from the command
//! line's clap definition, the chart values from `values.schema.json`
//! (every value described there) and their defaults from `values.yaml`.
//! The test fails when the page differs from what it generates;
//! `COZY_PROXY_WRITE_DOCS=1` writes the page's tables anew.
use clap::CommandFactory;
use cozy_proxy::cli::Cli;
use serde_json::Value;
use std::{fs, path::PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_path_buf()
}

/// A table cell: one line, `|` escaped.
fn cell(text: &str) -> String {
    text.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|")
}

/// The flags of `sub` (`None`: the global ones), as a table.
fn flags(sub: Option<&str>) -> String {
    let mut cli = Cli::command();
    cli.build();
    let cmd = match sub {
        Some(name) => cli
            .find_subcommand(name)
            .unwrap_or_else(|| panic!("no subcommand {name}"))
            .clone(),
        None => cli,
    };
    let mut out =
        String::from("| flag | environment | default | what it sets |\n|---|---|---|---|\n");
    for arg in cmd.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if arg.is_hide_set()
            || ["help", "version"].contains(&long)
            || (sub.is_some() && arg.is_global_set())
        {
            continue;
        }
        let value = match arg.get_value_names() {
            Some(names) if arg.get_num_args().is_some_and(|n| n.max_values() > 0) => {
                let bare = arg.get_num_args().is_some_and(|n| n.min_values() == 0);
                let name = names.join(" ");
                if bare {
                    format!("[={name}]")
                } else {
                    format!(" {name}")
                }
            }
            _ => String::new(),
        };
        let env = arg
            .get_env()
            .map(|e| format!("`{}`", e.to_string_lossy()))
            .unwrap_or_default();
        let default: Vec<String> = arg
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().to_string())
            .collect();
        let default = match default.join(",") {
            d if d.is_empty() => String::new(),
            d => format!("`{d}`"),
        };
        let help = arg
            .get_long_help()
            .or_else(|| arg.get_help())
            .map(|h| h.to_string())
            .unwrap_or_default();
        let possible: Vec<String> = arg
            .get_possible_values()
            .iter()
            .filter(|v| !v.is_hide_set())
            .map(|v| format!("`{}`", v.get_name()))
            .collect();
        let help = match (help.is_empty(), possible.is_empty() || value.is_empty()) {
            (_, true) => help,
            (true, false) => format!("one of {}", possible.join(", ")),
            (false, false) => format!("{help} (one of {})", possible.join(", ")),
        };
        assert!(!help.is_empty(), "--{long} has no help text");
        out.push_str(&format!(
            "| `--{long}{value}` | {env} | {default} | {} |\n",
            cell(&help)
        ));
    }
    out
}

/// The chart's values, as a table.
fn values() -> String {
    let chart = root().join("charts/cozy-proxy");
    let schema: Value = serde_json::from_str(
        &fs::read_to_string(chart.join("values.schema.json")).expect("values.schema.json"),
    )
    .expect("the schema is JSON");
    let defaults: serde_yaml::Value =
        serde_yaml::from_str(&fs::read_to_string(chart.join("values.yaml")).expect("values.yaml"))
            .expect("values.yaml is YAML");
    let mut out = String::from("| value | type | default | what it sets |\n|---|---|---|---|\n");
    leaves(&schema, &defaults, "", &mut out);
    out
}

fn leaves(schema: &Value, defaults: &serde_yaml::Value, prefix: &str, out: &mut String) {
    let Some(props) = schema["properties"].as_object() else {
        return;
    };
    for (name, prop) in props {
        let path = format!("{prefix}{name}");
        let default = defaults.get(name.as_str()).cloned().unwrap_or_default();
        if prop.get("properties").is_some() {
            leaves(prop, &default, &format!("{path}."), out);
            continue;
        }
        let what = prop["description"]
            .as_str()
            .unwrap_or_else(|| panic!("chart value {path} has no description in the schema"));
        let kind = match (&prop["type"], prop["enum"].as_array()) {
            (_, Some(options)) => options
                .iter()
                .map(|o| format!("`{}`", o.as_str().unwrap_or_default()))
                .collect::<Vec<_>>()
                .join(", "),
            (Value::String(t), None) => t.clone(),
            _ => String::new(),
        };
        let default = match serde_json::to_string(&default) {
            Ok(d) if d != "null" => format!("`{d}`"),
            _ => String::new(),
        };
        out.push_str(&format!(
            "| `{path}` | {kind} | {} | {} |\n",
            cell(&default),
            cell(what)
        ));
    }
}

/// The page with each `<!-- generated: NAME -->` ... `<!-- end -->` block
/// filled with what `NAME` generates.
fn generated(page: &str) -> String {
    let mut out = String::new();
    let mut rest = page;
    while let Some(start) = rest.find("<!-- generated: ") {
        let (before, tail) = rest.split_at(start);
        out.push_str(before);
        let close = tail.find("-->").expect("a closed marker") + 3;
        let marker = &tail[..close];
        let name = marker
            .trim_start_matches("<!-- generated: ")
            .trim_end_matches("-->")
            .trim();
        let end = tail.find("<!-- end -->").expect("an end marker");
        let table = match name {
            "global flags" => flags(None),
            "chart values" => values(),
            sub => flags(Some(sub.trim_end_matches(" flags"))),
        };
        out.push_str(&format!("{marker}\n{table}"));
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

#[test]
fn the_operating_page_tables_are_generated_from_the_cli_and_the_chart() {
    let path = root().join("docs/operating.md");
    let page = fs::read_to_string(&path).expect("docs/operating.md");
    let want = generated(&page);
    if std::env::var("COZY_PROXY_WRITE_DOCS").is_ok() {
        fs::write(&path, &want).expect("writing docs/operating.md");
        return;
    }
    assert!(
        page == want,
        "docs/operating.md differs from the CLI or the chart: run \
         COZY_PROXY_WRITE_DOCS=1 cargo test -p cozy-proxy --test docs"
    );
}
