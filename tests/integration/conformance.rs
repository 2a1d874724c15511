//! The official conformance suite (`@modelcontextprotocol/conformance@0.1.16`, every
//! server scenario) run through the gateway in front of a legacy fixture server written
//! with the TypeScript SDK. Scenarios that fail for reasons outside the gateway would be
//! listed, each with a one-line reason, in tests/conformance/expected-failures-0.1.16.yml;
//! none are needed. `server-sse-polling` passes with warnings only: the scenario declares
//! `mcp-protocol-version: 2025-03-26`, to which SDK servers send no SEP-1699 priming event;
//! `real_peers::sse_polling_resumes_through_the_gateway` covers polling at 2025-11-25.

use crate::common::*;
use std::time::Duration;

/// Scenarios the issue names explicitly; each must have run.
const REQUIRED: &[&str] = &[
    "tools-call-elicitation",
    "tools-call-sampling",
    "server-sse-polling",
    "server-sse-multiple-streams",
    "dns-rebinding-protection",
];

#[test]
fn conformance_0_1_16_server_scenarios_pass_through_the_gateway() {
    let (_upstream, url) = start_upstream(Upstream::Conformance);
    let gw = TestGateway::start(&[&url], &test_keys());
    let results = root().join("target/conformance-0.1.16");
    let _ = std::fs::remove_dir_all(&results);
    let cli =
        root().join("tests/fixtures/node_modules/@modelcontextprotocol/conformance/dist/index.js");
    let mut args = vec![
        cli.to_str().unwrap().to_string(),
        "server".into(),
        "--url".into(),
        gw.url.clone(),
        "--suite".into(),
        "all".into(),
        "-o".into(),
        results.to_str().unwrap().to_string(),
    ];
    let baseline = root().join("tests/conformance/expected-failures-0.1.16.yml");
    if baseline.exists() {
        args.extend([
            "--expected-failures".into(),
            baseline.to_str().unwrap().to_string(),
        ]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run_client(node(), &args, Duration::from_secs(300));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary = stdout.split("=== SUMMARY ===").nth(1).unwrap_or_default();
    println!("conformance 0.1.16 through the gateway:{summary}");
    assert!(
        out.status.success(),
        "the suite failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let total = summary
        .lines()
        .find(|l| l.starts_with("Total:"))
        .expect("a Total line");
    assert!(total.contains(" 0 failed"), "{total}");
    for scenario in REQUIRED {
        assert!(
            summary.contains(&format!("✓ {scenario}:")),
            "{scenario} did not pass or did not run"
        );
    }
    let scenarios = summary.lines().filter(|l| l.starts_with('✓')).count();
    assert!(scenarios >= 32, "only {scenarios} scenarios passed");
}
