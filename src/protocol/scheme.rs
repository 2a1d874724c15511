//! The scheme a request arrived over: `https` on a listener that serves TLS, `http`
//! otherwise. Forwarding headers name it to upstreams, and whatever builds the gateway's
//! own URLs takes it from here.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    Http,
    Https,
}

impl Scheme {
    /// `http` or `https`, as URLs and forwarding headers write it.
    pub fn as_str(self) -> &'static str {
        match self {
            Scheme::Http => "http",
            Scheme::Https => "https",
        }
    }

    /// The scheme of a connection that is, or is not, TLS.
    pub fn over_tls(tls: bool) -> Scheme {
        if tls {
            Scheme::Https
        } else {
            Scheme::Http
        }
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
