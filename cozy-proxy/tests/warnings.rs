//! Warnings that would repeat every round while their cause lasts are
//! logged when they appear and then at most once a minute (with how many
//! were held back); a skipped manifest is reported once while it stays
//! as it is. Needs root (the controller runs in a test node namespace).
use anyhow::{ensure, Result};
use cozy_proxy_testkit as harness;
use harness::{nodes::net::Fam, traffic::eventually, Backend, Env};
use std::{fs, time::Duration};

fn count(env: &Env, text: &str) -> usize {
    env.ctl.log_text().matches(text).count()
}

#[test]
fn a_lasting_problem_is_logged_once_not_every_poll() -> Result<()> {
    let env = Env::new(Backend::Nft, Fam::V4)?;
    eventually(Duration::from_secs(10), || {
        let (code, _) = env.controller_http("/readyz")?;
        ensure!(code == 200, "readyz {code}");
        Ok(())
    })?;
    // A document that cannot be read, the directory changed around it
    // a few times: reported once.
    env.dir
        .put("broken", "apiVersion: v1\nkind: Service\nmetadata: [\n")?;
    for i in 0..4 {
        std::thread::sleep(Duration::from_millis(600));
        env.dir.put("other", &format!("# {i}\n"))?;
    }
    std::thread::sleep(Duration::from_millis(600));
    let skipped = count(&env, "broken.yaml");
    ensure!(skipped == 1, "the broken manifest reported {skipped} times");
    // The directory gone, polled four times a second for 2.5 s: logged
    // once (the controller keeps the datapath as it is).
    let moved = env.dir.path.with_extension("away");
    fs::rename(&env.dir.path, &moved)?;
    std::thread::sleep(Duration::from_millis(2500));
    let unreadable = count(&env, "cannot read the manifest directory");
    fs::rename(&moved, &env.dir.path)?;
    ensure!(
        unreadable == 1,
        "an unreadable directory logged {unreadable} times in 2.5 s"
    );
    Ok(())
}
