//! The MRTR translator fed arbitrary upstream messages (one JSON value per line): no
//! panic; every input request it gathers is well formed; the InputRequiredResult it
//! builds names as many input requests as the round has pending questions, and carries
//! only the state when there are none.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mrtr_gateway::mrtr::state::UpstreamId;
use mrtr_gateway::mrtr::translate::{Action, Round};
use serde_json::{json, Value};

fuzz_target!(|input: &[u8]| {
    let Some((&flags, rest)) = input.split_first() else {
        return;
    };
    let capabilities = json!({"elicitation": {"form": {}, "url": {}}, "sampling": {}, "roots": {}});
    let capabilities = match flags & 1 {
        0 => capabilities.as_object().cloned().unwrap_or_default(),
        _ => Default::default(),
    };
    let mut round = Round::new(UpstreamId::Number(1), capabilities, flags & 2 != 0, None);
    for line in rest.split(|&b| b == b'\n') {
        let Ok(message) = serde_json::from_slice::<Value>(line) else {
            continue;
        };
        round.saw_call_event(&format!("1:{}", line.len()));
        for action in round.on_message(message) {
            if let Action::Complete(m) = &action {
                let _ = round.absorb_url_required(m);
            }
        }
    }
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
