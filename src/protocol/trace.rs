//! W3C trace context (`traceparent`, `tracestate`) carried from a client request to every
//! upstream request made on its behalf, as headers and in the call's `_meta`. Values are
//! checked before they are forwarded: a malformed `traceparent` or an oversized
//! `tracestate` is dropped, never passed on.

use serde_json::{Map, Value};

/// The W3C limit on `tracestate` (32 members of at most 256 bytes would exceed it; the
/// recommendation is to propagate at least 512 bytes).
const MAX_TRACESTATE: usize = 512;

/// A request's trace context, valid or absent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TraceContext {
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

/// `version-traceid-parentid-flags`, lowercase hex, 55 characters for version 00; later
/// versions may append fields after a dash. All-zero ids are invalid.
fn valid_traceparent(value: &str) -> bool {
    let fields: Vec<&str> = value.splitn(5, '-').collect();
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let nonzero = |s: &str| s.bytes().any(|b| b != b'0');
    match fields.as_slice() {
        [version, trace, parent, flags, rest @ ..] => {
            hex(version, 2)
                && *version != "ff"
                && (*version != "00" || rest.is_empty())
                && hex(trace, 32)
                && nonzero(trace)
                && hex(parent, 16)
                && nonzero(parent)
                && hex(flags, 2)
        }
        _ => false,
    }
}

impl TraceContext {
    /// The context of a request's headers; `tracestate` only travels with a valid
    /// `traceparent`.
    pub fn from_headers(traceparent: Option<&str>, tracestate: Option<&str>) -> TraceContext {
        let Some(parent) = traceparent.map(str::trim).filter(|p| valid_traceparent(p)) else {
            return TraceContext::default();
        };
        TraceContext {
            traceparent: Some(parent.to_string()),
            tracestate: tracestate
                .map(str::trim)
                .filter(|s| !s.is_empty() && s.len() <= MAX_TRACESTATE)
                .map(str::to_string),
        }
    }

    /// The headers to add to an upstream request.
    pub fn headers(&self) -> impl Iterator<Item = (&'static str, &str)> {
        [
            ("traceparent", &self.traceparent),
            ("tracestate", &self.tracestate),
        ]
        .into_iter()
        .filter_map(|(name, value)| value.as_deref().map(|v| (name, v)))
    }

    /// Adds the context to a request's `_meta` unless the client put its own there.
    pub fn fill_meta(&self, params: &mut Map<String, Value>) {
        let Some(parent) = &self.traceparent else {
            return;
        };
        let meta = params
            .entry("_meta")
            .or_insert_with(|| Value::Object(Map::new()));
        let Some(meta) = meta.as_object_mut() else {
            return;
        };
        if meta.contains_key("traceparent") {
            return;
        }
        meta.insert("traceparent".into(), Value::from(parent.as_str()));
        if let Some(state) = &self.tracestate {
            meta.insert("tracestate".into(), Value::from(state.as_str()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn only_well_formed_contexts_are_kept() {
        let t = TraceContext::from_headers(Some(PARENT), Some("congo=t61rcWkgMzE"));
        assert_eq!(t.traceparent.as_deref(), Some(PARENT));
        assert_eq!(t.headers().count(), 2);
        for bad in [
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "x",
        ] {
            let t = TraceContext::from_headers(Some(bad), Some("a=b"));
            assert_eq!(t, TraceContext::default(), "{bad}");
        }
        let future = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-later";
        assert!(TraceContext::from_headers(Some(future), None)
            .traceparent
            .is_some());
        let long = "a=".to_string() + &"b".repeat(MAX_TRACESTATE);
        let t = TraceContext::from_headers(Some(PARENT), Some(&long));
        assert_eq!(t.tracestate, None, "an oversized tracestate is dropped");
    }

    #[test]
    fn meta_gets_the_context_unless_the_client_set_its_own() {
        let t = TraceContext::from_headers(Some(PARENT), Some("a=b"));
        let mut params = Map::new();
        t.fill_meta(&mut params);
        assert_eq!(
            Value::Object(params),
            json!({"_meta": {"traceparent": PARENT, "tracestate": "a=b"}})
        );
        let own = "00-11111111111111111111111111111111-2222222222222222-00";
        let mut params = json!({"_meta": {"traceparent": own}})
            .as_object()
            .cloned()
            .unwrap();
        t.fill_meta(&mut params);
        assert_eq!(params["_meta"]["traceparent"], own);
        assert!(params["_meta"].get("tracestate").is_none());
    }
}
