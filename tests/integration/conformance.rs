//! The official conformance suite through the gateway, in front of a legacy fixture
//! server written with the TypeScript SDK (tests/fixtures/conformance_server.mjs):
//!
//! - `@modelcontextprotocol/conformance@0.1.16`, every server scenario, legacy clients
//!   passing through. No expected failures. `server-sse-polling` passes with warnings
//!   only: the scenario declares `mcp-protocol-version: 2025-03-26`, to which SDK servers
//!   send no SEP-1699 priming event; `real_peers::sse_polling_resumes_through_the_gateway`
//!   covers polling at 2025-11-25.
//! - `0.2.0-alpha.12 --requirements 2026-07-28`: modern clients through the MRTR bridge.
//!   Every scored scenario must pass, including the 14 `input-required-result-*`. The
//!   suite also runs unscored extension (tasks) and pending scenarios; their results are
//!   printed, not asserted.

use crate::common::*;
use std::time::Duration;

/// Runs the suite `package` against a fresh gateway and fixture; returns the summary.
fn run_suite(package: &str, args: &[&str], results: &str) -> String {
    let (_upstream, url) = start_upstream(Upstream::Conformance);
    let gw = TestGateway::start(&[&url], &test_keys());
    let out_dir = root().join("target").join(results);
    let _ = std::fs::remove_dir_all(&out_dir);
    let cli = root()
        .join("tests/fixtures/node_modules")
        .join(package)
        .join("dist/index.js");
    let (cli, out_dir) = (
        cli.to_str().unwrap().to_string(),
        out_dir.to_str().unwrap().to_string(),
    );
    let mut all = vec![
        cli.as_str(),
        "server",
        "--url",
        gw.url.as_str(),
        "-o",
        out_dir.as_str(),
    ];
    all.extend_from_slice(args);
    let out = run_client(node(), &all, Duration::from_secs(600));
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let summary = stdout
        .split("=== SUMMARY ===")
        .nth(1)
        .unwrap_or_default()
        .to_string();
    println!("{package} {args:?} through the gateway:{summary}");
    assert!(
        out.status.success(),
        "the suite failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    summary
}

fn assert_passed(summary: &str, scenario: &str) {
    assert!(
        summary.contains(&format!("✓ {scenario}:")),
        "{scenario} did not pass or did not run"
    );
}

#[test]
fn conformance_0_1_16_server_scenarios_pass_through_the_gateway() {
    let summary = run_suite(
        "@modelcontextprotocol/conformance",
        &["--suite", "all"],
        "conformance-0.1.16",
    );
    let total = summary
        .lines()
        .find(|l| l.starts_with("Total:"))
        .expect("a Total line");
    assert!(total.contains(" 0 failed"), "{total}");
    for scenario in [
        "tools-call-elicitation",
        "tools-call-sampling",
        "server-sse-polling",
        "server-sse-multiple-streams",
        "dns-rebinding-protection",
    ] {
        assert_passed(&summary, scenario);
    }
    let scenarios = summary.lines().filter(|l| l.starts_with('✓')).count();
    assert!(scenarios >= 32, "only {scenarios} scenarios passed");
}

#[test]
fn conformance_2026_07_28_requirements_pass_through_the_bridge() {
    let summary = run_suite(
        "conformance-next",
        &["--requirements", "2026-07-28"],
        "conformance-2026-07-28",
    );
    // The suite lists every scenario it ran, then again the ones not scored for the
    // revision (extensions, pending); every failure must be among the latter.
    let (table, unscored) = summary
        .split_once("Not scored")
        .expect("a not-scored section");
    let name = |l: &str| {
        l.trim_start_matches(['✓', '✗', ' '])
            .split([':', ' '])
            .next()
            .unwrap_or("")
            .to_string()
    };
    let unscored: Vec<String> = unscored
        .lines()
        .filter(|l| l.trim_start().starts_with('✗'))
        .map(|l| name(l.trim_start()))
        .collect();
    let failing: Vec<String> = table
        .lines()
        .filter(|l| l.starts_with('✗'))
        .map(name)
        .filter(|n| !unscored.contains(n))
        .collect();
    assert!(failing.is_empty(), "scored scenarios failed: {failing:?}");
    let scored = table;
    const MRTR: &[&str] = &[
        "basic-elicitation",
        "basic-sampling",
        "basic-list-roots",
        "request-state",
        "multiple-input-requests",
        "multi-round",
        "missing-input-response",
        "non-tool-request",
        "result-type",
        "unsupported-methods",
        "tampered-state",
        "capability-check",
        "ignore-extra-params",
        "validate-input",
    ];
    for name in MRTR {
        assert_passed(scored, &format!("input-required-result-{name}"));
    }
    for scenario in [
        "server-stateless",
        "http-header-validation",
        "caching",
        "dns-rebinding-protection",
    ] {
        assert_passed(&summary, scenario);
    }
}
