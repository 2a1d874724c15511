//! The MRTR translator fed arbitrary upstream messages (one JSON value per line): no
//! panic; every input request it gathers is well formed; a round never gathers more
//! questions or bytes than its limits (it is full at the count, and fails beyond the
//! bytes); every pending question has its own key; the InputRequiredResult it builds
//! names as many input requests as the round has pending questions, and carries only the
//! state when there are none.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mrtr_gateway::mrtr::modern::LogLevel;
use mrtr_gateway::mrtr::state::UpstreamId;
use mrtr_gateway::mrtr::translate::{Action, Relay, Round, RoundLimits};
use serde_json::{json, Value};

/// What the round's request asked for: progress under a token, logs from a level.
fn relay(flags: u8) -> Relay {
    Relay {
        progress_token: (flags & 2 != 0).then(|| json!("p")),
        log_level: (flags & 2 != 0).then_some(LogLevel::Debug),
    }
}

fuzz_target!(|input: &[u8]| {
    let Some((&flags, rest)) = input.split_first() else {
        return;
    };
    let capabilities = json!({"elicitation": {"form": {}, "url": {}}, "sampling": {}, "roots": {}});
    let capabilities = match flags & 1 {
        0 => capabilities.as_object().cloned().unwrap_or_default(),
        _ => Default::default(),
    };
    let limits = RoundLimits {
        max_questions: 1 + usize::from(flags >> 4),
        max_bytes: 2048,
    };
    let mut round =
        Round::new(UpstreamId::Number(1), capabilities, relay(flags), None).bounded(limits);
    for line in rest.split(|&b| b == b'\n') {
        if round.is_full() {
            break; // the shell ends the round here
        }
        let Ok(message) = serde_json::from_slice::<Value>(line) else {
            continue;
        };
        round.saw_call_event(&format!("1:{}", line.len()));
        let mut failed = false;
        for action in round.on_message(message) {
            match &action {
                Action::Complete(m) => {
                    let _ = round.absorb_url_required(m);
                }
                Action::Fail(why) => {
                    assert!(!why.is_empty(), "a failure without a reason");
                    failed = true;
                }
                _ => {}
            }
        }
        if failed {
            return; // the shell ends the call here
        }
    }
    assert!(
        round.pending().len() <= limits.max_questions,
        "a round gathered more questions than its limit"
    );
    let mut keys: Vec<&str> = round.pending().iter().map(|p| p.key.as_str()).collect();
    keys.sort_unstable();
    let before = keys.len();
    keys.dedup();
    assert_eq!(before, keys.len(), "two pending questions share a key");
    let result = round.input_required("state".into());
    assert_eq!(result["resultType"], "input_required");
    // Without questions the result carries only the state (a handed-over round).
    let Some(requests) = result.get("inputRequests") else {
        assert_eq!(round.question_count(), 0, "questions without inputRequests");
        return;
    };
    let requests = requests.as_object().expect("an object");
    assert!(!requests.is_empty(), "an empty inputRequests");
    assert_eq!(requests.len(), round.question_count());
    for (key, request) in requests {
        assert!(!key.is_empty(), "an empty input key");
        assert!(
            request["method"].is_string(),
            "an input request without a method"
        );
        assert!(request.get("id").is_none() && request.get("jsonrpc").is_none());
    }
});
