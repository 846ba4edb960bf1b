//! A stand-in for the Kubernetes API server, for tests: the real kube-rs
//! client code of `cozy-proxy run` is exercised against it where a real
//! API server is not (yet) used.
//!
//! It serves what cozy-proxy uses, the way the API server does: list and
//! watch (`?watch=true&resourceVersion=N`, chunked JSON lines, bookmarks,
//! `labelSelector`, `fieldSelector`, timeouts) of Services, EndpointSlices
//! and Nodes, a list of one namespace's EndpointSlices, GET of one Node,
//! and POST/PATCH of events.k8s.io/v1 Events.
//! Its objects are the YAML manifests in `--dir`: every change of the
//! directory becomes ADDED/MODIFIED/DELETED watch events with increasing
//! resourceVersions (time-based, so they keep increasing across restarts).
//!
//! Faults on demand: `POST /control/cut` closes every open watch;
//! `POST /control/compact` forgets history, so older resourceVersions get
//! `410 Gone` (open watches get an Expired ERROR event). `GET
//! /control/events` lists the Events received. `POST /control/apply` (a JSON
//! object, or an array of them: a burst) creates or replaces objects at
//! once.
use serde_json::{json, Value};
use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime, UNIX_EPOCH},
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::{broadcast, watch},
};

/// (kind, namespace, name)
type Key = (String, String, String);

#[derive(Clone, Debug)]
struct Change {
    rv: u64,
    kind: String,
    event: &'static str,
    object: Value,
}

struct State {
    objects: BTreeMap<Key, Value>,
    history: Vec<Change>,
    /// Watches from before this resourceVersion get 410 Gone.
    oldest: u64,
    rv: u64,
    events: Vec<Value>,
}

struct Server {
    state: Mutex<State>,
    changes: broadcast::Sender<Change>,
    /// Bumped by /control/cut and /control/compact: open watches end.
    epoch: watch::Sender<u64>,
}

fn now_rv() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_micros() as u64)
}

fn read_dir(dir: &PathBuf) -> BTreeMap<Key, Value> {
    let mut out = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    let mut files: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    files.sort();
    for f in files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "yaml"))
    {
        let Ok(text) = std::fs::read_to_string(f) else {
            continue;
        };
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let Ok(v) = serde::Deserialize::deserialize(doc).map(|v: serde_yaml::Value| v) else {
                break;
            };
            let Ok(v) = serde_json::to_value(v) else {
                continue;
            };
            let key = key_of(&v);
            if !matches!(
                key.0.as_str(),
                "Service" | "EndpointSlice" | "Node" | "DaemonSet"
            ) {
                continue;
            }
            out.insert(key, v);
        }
    }
    out
}

/// The key of an object as the stand-in files it.
fn key_of(v: &Value) -> Key {
    let kind = v["kind"].as_str().unwrap_or_default().to_string();
    let ns = if kind == "Node" {
        String::new()
    } else {
        v["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_string()
    };
    let name = v["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    (kind, ns, name)
}

/// The uid the stand-in gives Service `namespace/name`: what an
/// EndpointSlice the controller would write names as its owner.
pub fn service_uid(namespace: &str, name: &str) -> String {
    uid_of(&("Service".into(), namespace.into(), name.into()))
}

/// The uid the API server would give object `key`: a UUID (random there;
/// here drawn from the key, so that it is kept across updates as there).
fn uid_of(key: &Key) -> String {
    use std::hash::{Hash, Hasher};
    let half = |salt: u8| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (salt, key).hash(&mut h);
        h.finish()
    };
    let n = (u128::from(half(0)) << 64) | u128::from(half(1));
    let hex = format!("{n:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

/// Stores `spec` under `key` as the API server would (resourceVersion,
/// uid, creationTimestamp kept from the existing object): the watch event,
/// or `None` if nothing changed.
fn upsert(st: &mut State, key: &Key, spec: &Value) -> Option<Change> {
    let existing = st.objects.get(key).cloned();
    let mut stripped = existing.clone().unwrap_or(Value::Null);
    if let Some(m) = stripped.get_mut("metadata").and_then(Value::as_object_mut) {
        m.remove("resourceVersion");
        m.remove("uid");
        if spec["metadata"]["creationTimestamp"].is_null() {
            m.remove("creationTimestamp");
        }
    }
    if stripped == *spec {
        return None;
    }
    st.rv = st.rv.max(now_rv()) + 1;
    let mut obj = spec.clone();
    let meta = &mut obj["metadata"];
    meta["resourceVersion"] = json!(st.rv.to_string());
    meta["uid"] = json!(uid_of(key));
    if meta["creationTimestamp"].is_null() {
        meta["creationTimestamp"] = existing
            .as_ref()
            .map(|e| e["metadata"]["creationTimestamp"].clone())
            .unwrap_or_else(|| json!("2024-01-01T00:00:00Z"));
    }
    let event = if existing.is_some() {
        "MODIFIED"
    } else {
        "ADDED"
    };
    st.objects.insert(key.clone(), obj.clone());
    Some(Change {
        rv: st.rv,
        kind: key.0.clone(),
        event,
        object: obj,
    })
}

impl Server {
    /// Applies the directory's content: one watch event per difference.
    fn rescan(&self, dir: &PathBuf) {
        let wanted = read_dir(dir);
        let mut st = self.state.lock().expect("lock");
        let mut changes = Vec::new();
        for (key, spec) in &wanted {
            changes.extend(upsert(&mut st, key, spec));
        }
        let gone: Vec<Key> = st
            .objects
            .keys()
            .filter(|k| !wanted.contains_key(*k))
            .cloned()
            .collect();
        for key in gone {
            st.rv = st.rv.max(now_rv()) + 1;
            let mut obj = st.objects.remove(&key).unwrap_or(Value::Null);
            obj["metadata"]["resourceVersion"] = json!(st.rv.to_string());
            changes.push(Change {
                rv: st.rv,
                kind: key.0.clone(),
                event: "DELETED",
                object: obj,
            });
        }
        self.publish(&mut st, changes);
    }

    /// Creates or replaces one object, or each of an array of them
    /// (`POST /control/apply`): true when any changed.
    fn apply(&self, spec: &Value) -> bool {
        let specs = match spec {
            Value::Array(all) => all.iter().collect(),
            one => vec![one],
        };
        let mut st = self.state.lock().expect("lock");
        let changes: Vec<Change> = specs
            .into_iter()
            .filter_map(|s| upsert(&mut st, &key_of(s), s))
            .collect();
        let changed = !changes.is_empty();
        self.publish(&mut st, changes);
        changed
    }

    fn publish(&self, st: &mut State, changes: Vec<Change>) {
        for c in changes {
            st.history.push(c.clone());
            let _ = self.changes.send(c);
        }
    }
}

/// The query parameters of a request path.
fn query(path: &str) -> BTreeMap<String, String> {
    let Some((_, q)) = path.split_once('?') else {
        return BTreeMap::new();
    };
    q.split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), percent_decode(v)))
        .collect()
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Label selector terms: `k`, `!k`, `k=v`, `k==v`, `k!=v`.
fn labels_match(obj: &Value, selector: &str) -> bool {
    let labels = &obj["metadata"]["labels"];
    selector.split(',').filter(|t| !t.is_empty()).all(|term| {
        if let Some((k, v)) = term.split_once("!=") {
            labels[k].as_str() != Some(v)
        } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            labels[k].as_str() == Some(v)
        } else if let Some(k) = term.strip_prefix('!') {
            labels[k].is_null()
        } else {
            !labels[term].is_null()
        }
    })
}

/// Field selector terms: `metadata.name=X`, `metadata.namespace=Y`.
fn fields_match(obj: &Value, selector: &str) -> bool {
    selector
        .split(',')
        .filter(|t| !t.is_empty())
        .all(|term| match term.split_once('=') {
            Some(("metadata.name", v)) => obj["metadata"]["name"].as_str() == Some(v),
            Some(("metadata.namespace", v)) => obj["metadata"]["namespace"].as_str() == Some(v),
            _ => true,
        })
}

fn selected(obj: &Value, q: &BTreeMap<String, String>) -> bool {
    labels_match(obj, q.get("labelSelector").map_or("", String::as_str))
        && fields_match(obj, q.get("fieldSelector").map_or("", String::as_str))
}

async fn respond(stream: &mut TcpStream, status: &str, body: &Value) -> std::io::Result<()> {
    let body = body.to_string();
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}

async fn chunk(stream: &mut TcpStream, line: &Value) -> std::io::Result<()> {
    let data = format!("{line}\n");
    stream
        .write_all(format!("{:x}\r\n{data}\r\n", data.len()).as_bytes())
        .await
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message, "reason": reason, "code": code})
}

async fn watch_stream(
    server: Arc<Server>,
    mut stream: TcpStream,
    kind: &str,
    q: BTreeMap<String, String>,
) -> std::io::Result<()> {
    let since: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|v| v.parse().ok())
        .unwrap_or(290u64);
    let mut live = server.changes.subscribe();
    let mut epoch = server.epoch.subscribe();
    let (backlog, oldest, rv) = {
        let st = server.state.lock().expect("lock");
        let backlog: Vec<Change> = st
            .history
            .iter()
            .filter(|c| c.rv > since && c.kind == kind)
            .cloned()
            .collect();
        (backlog, st.oldest, st.rv)
    };
    stream
        .write_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        .await?;
    if since != 0 && since < oldest {
        let gone = status(
            410,
            "Expired",
            &format!("too old resource version: {since} ({oldest})"),
        );
        chunk(&mut stream, &json!({"type": "ERROR", "object": gone})).await?;
        return stream.write_all(b"0\r\n\r\n").await;
    }
    for c in backlog.iter().filter(|c| selected(&c.object, &q)) {
        chunk(&mut stream, &json!({"type": c.event, "object": c.object})).await?;
    }
    let bookmark_kind = kind.to_string();
    let mut last_rv = backlog.last().map_or(rv.max(since), |c| c.rv);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout);
    let mut bookmarks = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            c = live.recv() => match c {
                Ok(c) if c.kind == kind && c.rv > last_rv => {
                    last_rv = c.rv;
                    if selected(&c.object, &q) {
                        chunk(&mut stream, &json!({"type": c.event, "object": c.object})).await?;
                    }
                }
                Ok(_) => {}
                Err(_) => break,
            },
            _ = bookmarks.tick() => {
                let api_version = if bookmark_kind == "EndpointSlice" { "discovery.k8s.io/v1" } else { "v1" };
                let mark = json!({"type": "BOOKMARK", "object": {"kind": bookmark_kind, "apiVersion": api_version, "metadata": {"resourceVersion": last_rv.to_string()}}});
                chunk(&mut stream, &mark).await?;
            }
            _ = epoch.changed() => {
                let st_oldest = server.state.lock().expect("lock").oldest;
                if last_rv < st_oldest {
                    let gone = status(410, "Expired", "watch expired by compaction");
                    chunk(&mut stream, &json!({"type": "ERROR", "object": gone})).await?;
                }
                // A cut: the connection just ends, as when an API server restarts.
                return stream.shutdown().await;
            }
            _ = tokio::time::sleep_until(deadline) => break,
        }
    }
    stream.write_all(b"0\r\n\r\n").await?;
    stream.shutdown().await
}

async fn handle(server: Arc<Server>, mut stream: TcpStream) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 8192];
    let head_end = loop {
        let n = stream.read(&mut tmp).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&tmp[..n]);
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut lines = head.lines();
    let mut first = lines.next().unwrap_or_default().split_whitespace();
    let (method, path) = (
        first.next().unwrap_or("GET").to_string(),
        first.next().unwrap_or("/").to_string(),
    );
    let length: usize = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + length {
        let n = stream.read(&mut tmp).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&tmp[..n]);
    }
    let body: Value = serde_json::from_slice(&buf[head_end..]).unwrap_or(Value::Null);
    let q = query(&path);
    let route = path.split('?').next().unwrap_or("/").to_string();
    const SLICES: (&str, &str, &str) =
        ("EndpointSlice", "discovery.k8s.io/v1", "EndpointSliceList");
    // A list of one namespace's EndpointSlices (a Service's, by label).
    let in_namespace = route
        .strip_prefix("/apis/discovery.k8s.io/v1/namespaces/")
        .and_then(|r| r.strip_suffix("/endpointslices"))
        .map(str::to_string);
    let list_kind = match route.as_str() {
        "/api/v1/services" => Some(("Service", "v1", "ServiceList")),
        "/apis/discovery.k8s.io/v1/endpointslices" => Some(SLICES),
        "/api/v1/nodes" => Some(("Node", "v1", "NodeList")),
        _ if in_namespace.is_some() => Some(SLICES),
        _ => None,
    };
    let in_scope = |o: &Value| {
        (in_namespace.as_deref()).is_none_or(|ns| o["metadata"]["namespace"].as_str() == Some(ns))
    };
    if let (Some((kind, api_version, list)), "GET") = (list_kind, method.as_str()) {
        if q.get("watch").is_some_and(|w| w == "true" || w == "1") {
            return watch_stream(server, stream, kind, q).await;
        }
        // Pages of `limit` items, as the API server cuts them (the
        // `continue` token: the list's resourceVersion and the next offset).
        let (rv, offset) = match q.get("continue").and_then(|c| c.split_once(':')) {
            Some((rv, at)) => (rv.parse().ok(), at.parse().unwrap_or(0)),
            None => (None, 0),
        };
        let limit: usize = q
            .get("limit")
            .and_then(|l| l.parse().ok())
            .filter(|l| *l > 0)
            .unwrap_or(usize::MAX);
        let (items, rv, more) = {
            let st = server.state.lock().expect("lock");
            let mut matching = st
                .objects
                .iter()
                .filter(|(k, o)| k.0 == kind && in_scope(o) && selected(o, &q))
                .skip(offset);
            let items: Vec<Value> = matching
                .by_ref()
                .take(limit)
                .map(|(_, o)| o.clone())
                .collect();
            (items, rv.unwrap_or(st.rv), matching.next().is_some())
        };
        let mut metadata = json!({"resourceVersion": rv.to_string()});
        if more {
            metadata["continue"] = json!(format!("{rv}:{}", offset + limit));
        }
        let body =
            json!({"kind": list, "apiVersion": api_version, "metadata": metadata, "items": items});
        return respond(&mut stream, "200 OK", &body).await;
    }
    // GET of one object: a Node, or our DaemonSet.
    let one = route
        .strip_prefix("/api/v1/nodes/")
        .map(|name| ("Node", "", name, "nodes"))
        .or_else(|| {
            let rest = route.strip_prefix("/apis/apps/v1/namespaces/")?;
            let (ns, name) = rest.split_once("/daemonsets/")?;
            Some(("DaemonSet", ns, name, "daemonsets.apps"))
        });
    if let (Some((kind, ns, name, resource)), "GET") = (one, method.as_str()) {
        let key = (kind.to_string(), ns.to_string(), name.to_string());
        let found = server
            .state
            .lock()
            .expect("lock")
            .objects
            .get(&key)
            .cloned();
        return match found {
            Some(obj) => respond(&mut stream, "200 OK", &obj).await,
            None => {
                let missing = status(404, "NotFound", &format!("{resource} \"{name}\" not found"));
                respond(&mut stream, "404 Not Found", &missing).await
            }
        };
    }
    if route.starts_with("/apis/events.k8s.io/v1/namespaces/")
        && (method == "POST" || method == "PATCH")
    {
        server
            .state
            .lock()
            .expect("lock")
            .events
            .push(json!({"method": method, "path": route, "body": body}));
        let mut obj = body.clone();
        if obj["metadata"]["name"].is_null() {
            obj["metadata"]["name"] = json!(format!("event-{}", now_rv()));
        }
        let code = if method == "POST" {
            "201 Created"
        } else {
            "200 OK"
        };
        return respond(&mut stream, code, &obj).await;
    }
    match (method.as_str(), route.as_str()) {
        ("GET", "/control/events") => {
            let events = server.state.lock().expect("lock").events.clone();
            respond(&mut stream, "200 OK", &json!(events)).await
        }
        ("POST", "/control/apply") => {
            let changed = server.apply(&body);
            respond(&mut stream, "200 OK", &json!({"changed": changed})).await
        }
        ("POST", "/control/cut") => {
            server.epoch.send_modify(|e| *e += 1);
            respond(&mut stream, "200 OK", &json!({"cut": true})).await
        }
        ("POST", "/control/compact") => {
            {
                let mut st = server.state.lock().expect("lock");
                st.rv = st.rv.max(now_rv()) + 1;
                st.oldest = st.rv;
                st.history.clear();
            }
            server.epoch.send_modify(|e| *e += 1);
            respond(&mut stream, "200 OK", &json!({"compacted": true})).await
        }
        ("GET", "/version") => {
            respond(
                &mut stream,
                "200 OK",
                &json!({"major": "1", "minor": "33", "gitVersion": "v1.33.0-standin"}),
            )
            .await
        }
        _ => {
            respond(
                &mut stream,
                "404 Not Found",
                &status(404, "NotFound", &format!("{method} {route}")),
            )
            .await
        }
    }
}

/// The stand-in running on a thread of its own, entered into a network
/// namespace: dropping it stops the server and closes every connection (as
/// an API server that dies).
pub struct Running {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Running {
    /// Serves `dir` on `listen` inside network namespace `netns` (a name
    /// under /var/run/netns).
    pub fn start(netns: &str, dir: PathBuf, listen: &str) -> std::io::Result<Running> {
        Self::start_with(netns, dir, listen, true)
    }

    /// As [`Running::start`], with the directory read once: later changes
    /// come only through `POST /control/apply` (for many objects, where a
    /// rescan every 50 ms would cost more than what is measured).
    pub fn start_static(netns: &str, dir: PathBuf, listen: &str) -> std::io::Result<Running> {
        Self::start_with(netns, dir, listen, false)
    }

    fn start_with(
        netns: &str,
        dir: PathBuf,
        listen: &str,
        rescan: bool,
    ) -> std::io::Result<Running> {
        let ns = std::fs::File::open(format!("/var/run/netns/{netns}"))?;
        let listen = listen.to_string();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (bound, ready) = std::sync::mpsc::channel::<std::io::Result<()>>();
        let thread = std::thread::spawn(move || {
            use std::os::fd::AsRawFd;
            // SAFETY: setns on a namespace file we opened; it affects only
            // this thread, which owns the runtime below.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                let _ = bound.send(Err(std::io::Error::last_os_error()));
                return;
            }
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = bound.send(Err(e));
                    return;
                }
            };
            rt.block_on(async move {
                let listener = match TcpListener::bind(&listen).await {
                    Ok(l) => {
                        let _ = bound.send(Ok(()));
                        l
                    }
                    Err(e) => {
                        let _ = bound.send(Err(e));
                        return;
                    }
                };
                tokio::select! {
                    _ = serve_with(listener, dir, rescan) => {}
                    _ = stopped => {}
                }
            });
            // Dropping the runtime drops every connection task.
        });
        match ready.recv() {
            Ok(Ok(())) => Ok(Running {
                stop: Some(stop),
                thread: Some(thread),
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(std::io::Error::other("the stand-in thread died")),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Serves the objects of `dir` (rescanned every 50 ms) until dropped.
pub async fn serve(listener: TcpListener, dir: PathBuf) {
    serve_with(listener, dir, true).await
}

async fn serve_with(listener: TcpListener, dir: PathBuf, rescan: bool) {
    // Room for a burst of changes (the bench writes 10 000 at once): a
    // watcher that falls further behind is cut, and resumes from history.
    let (changes, _) = broadcast::channel(1 << 16);
    let (epoch, _) = watch::channel(0);
    let start = now_rv();
    let server = Arc::new(Server {
        state: Mutex::new(State {
            objects: BTreeMap::new(),
            history: Vec::new(),
            oldest: start,
            rv: start,
            events: Vec::new(),
        }),
        changes,
        epoch,
    });
    server.rescan(&dir);
    if rescan {
        let scanner = server.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            loop {
                tick.tick().await;
                scanner.rescan(&dir);
            }
        });
    }
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        // As Go's net package does for every TCP connection of the API
        // server: no Nagle delay on the small chunks of a watch.
        let _ = stream.set_nodelay(true);
        let server = server.clone();
        tokio::spawn(async move {
            let _ = handle(server, stream).await;
        });
    }
}
