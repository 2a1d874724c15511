//! The command line: `check-config`, `keygen`, and `demo`, whose printed walkthrough is
//! run exactly as printed.

use crate::common::*;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

fn binary() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mrtr-gateway"))
}

#[test]
fn check_config_accepts_the_example_and_names_the_key_path_of_a_problem() {
    let ok = binary()
        .arg("check-config")
        .arg(root().join("config/gateway.yaml"))
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );

    let dir = std::env::temp_dir().join(format!("mrtr-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.yaml");
    std::fs::write(&bad, "upstreams:\n  - name: a\n    endpoints: [\"http://127.0.0.1:1/mcp\"]\n    connect_timeout_ms: 0\n").unwrap();
    let out = binary().arg("check-config").arg(&bad).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("upstreams[0].connect_timeout_ms"),
        "{stderr}"
    );

    std::fs::write(
        &bad,
        "listen: 127.0.0.1:1\nupstreams:\n  - name: a\n    endpionts: []\n",
    )
    .unwrap();
    let out = binary().arg("check-config").arg(&bad).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("upstreams[0]") && stderr.contains("endpionts"),
        "{stderr}"
    );
}

/// `check-config` checks what `run` would run: the same flags and environment apply.
#[test]
fn check_config_takes_the_flags_run_takes() {
    let dir = std::env::temp_dir().join(format!("mrtr-check-flags-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("listen-only.yaml");
    std::fs::write(&file, "listen: 127.0.0.1:18080\n").unwrap();
    let check = |args: &[&str]| {
        let out = binary()
            .arg("check-config")
            .arg(&file)
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // A file that relies on --upstream, as a drop-in does.
    let (ok, stderr) = check(&["--upstream", "http://127.0.0.1:3001/mcp"]);
    assert!(ok, "{stderr}");
    let (ok, _) = check(&[]);
    assert!(!ok, "no upstream at all");
    // A flag that makes the listeners clash.
    let clash = [
        "--upstream",
        "http://127.0.0.1:3001/mcp",
        "--admin-listen",
        "127.0.0.1:18080",
    ];
    let (ok, stderr) = check(&clash);
    assert!(!ok && stderr.contains("admin_listen"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn keygen_prints_a_key_the_ring_accepts() {
    let out = binary()
        .args(["keygen", "--kid", "prod-2026"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let entry = String::from_utf8(out.stdout).unwrap();
    let ring = mrtr_gateway::keys::KeyRing::parse(entry.trim()).unwrap();
    assert_eq!(ring.current().kid(), "prod-2026");
    let bad = binary()
        .args(["keygen", "--kid", "no spaces"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
}

#[test]
fn run_refuses_bad_keys_and_a_missing_upstream() {
    let out = binary()
        .args([
            "run",
            "--listen",
            "127.0.0.1:1",
            "--admin-listen",
            "127.0.0.1:2",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("upstream"));
    let out = binary()
        .args(["run", "--upstream", "http://127.0.0.1:1/mcp"])
        .env("MRTR_GATEWAY_KEYS", "k1:short")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("MRTR_GATEWAY_KEYS"));
}

#[test]
fn demo_walkthrough_works_as_printed() {
    let (gw, admin, demo) = (free_port(), free_port(), free_port());
    let mut child = binary()
        .args([
            "demo",
            "--listen",
            &format!("127.0.0.1:{gw}"),
            "--admin-listen",
            &format!("127.0.0.1:{admin}"),
        ])
        .args(["--demo-listen", &format!("127.0.0.1:{demo}")])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut printed = String::new();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        let last = line.contains("-X DELETE");
        printed.push_str(&line);
        printed.push('\n');
        if last {
            break;
        }
    }
    let _proc = Proc::adopt(child, "demo");
    wait_until("demo gateway", Duration::from_secs(10), || port_open(gw));
    let script = printed
        .split_once("\nGW=")
        .map(|(_, s)| format!("GW={s}"))
        .expect("a walkthrough");
    let out = run_client("bash".into(), &["-c", &script], Duration::from_secs(30));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("\"resultType\":\"input_required\""),
        "{stdout}"
    );
    assert!(
        stdout.contains("How many nights in Lisbon?"),
        "the second round: {stdout}"
    );
    assert!(
        stdout.contains("Trip to Lisbon for 3 nights"),
        "the MRTR result: {stdout}"
    );
    assert!(stdout.contains("elicitation/create"), "{stdout}");
    assert!(
        stdout.contains("\n202\n"),
        "the answer was not accepted: {stdout}"
    );
    assert!(stdout.contains("Hello, Ada!"), "{stdout}");
    assert!(
        stdout.trim_end().ends_with("200"),
        "DELETE did not succeed: {stdout}"
    );
}

/// The demo server takes one standalone GET stream per session at a time (409 for a
/// second), and another once the first one's client has left, as SDK servers do: it
/// refused every later one for the session's life.
#[test]
fn the_demo_server_takes_a_new_get_stream_once_the_last_one_closed() {
    let port = free_port();
    let child = binary()
        .args(["demo-server", "--listen", &format!("127.0.0.1:{port}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _proc = Proc::adopt(child, "demo server");
    wait_until("demo server", Duration::from_secs(10), || port_open(port));
    let raw = Raw::new(&format!("http://127.0.0.1:{port}/mcp"));
    let session = raw.initialize(serde_json::json!({}));
    let get = |session: &str| {
        let request = format!(
            "GET /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\naccept: text/event-stream\r\n\
             mcp-session-id: {session}\r\nmcp-protocol-version: 2025-11-25\r\n\r\n"
        );
        let (status, stream) = raw_status(port, request.as_bytes(), Duration::from_secs(5));
        (status[9..].to_string(), stream)
    };
    let (first, open) = get(&session);
    assert_eq!(first, "200");
    assert_eq!(get(&session).0, "409", "one at a time");
    drop(open);
    wait_until("a new GET stream", Duration::from_secs(5), || {
        get(&session).0 == "200"
    });
}

/// Pingora binds the MCP listener only once its service runs, and gives up on an address
/// in use after half a minute of retries while the rest of the process (the admin
/// listener, ready) stays up. `run` must refuse at start instead.
#[test]
fn run_refuses_a_listen_address_in_use() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let listen = taken.local_addr().unwrap().to_string();
    let admin = format!("127.0.0.1:{}", free_port());
    let mut child = binary()
        .args(["run", "--listen", &listen, "--admin-listen", &admin])
        .args(["--upstream", "http://127.0.0.1:1/mcp"])
        .env("MRTR_GATEWAY_KEYS", test_keys())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let mut proc = Proc::adopt(child, "gateway");
    let status = proc.status_within(Duration::from_secs(10));
    assert!(!status.success(), "{status}");
    let mut printed = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut printed).unwrap();
    let refusal = format!("listen: cannot listen on {listen}");
    assert!(printed.contains(&refusal), "{printed}");
    // Log lines to a pipe carry no colour codes.
    assert!(
        printed.contains(" INFO ") && !printed.contains('\u{1b}'),
        "{printed:?}"
    );
    drop(taken);
}
