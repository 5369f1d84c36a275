//! Why a connection to a backend failed, named for the operator who has to fix it: refused,
//! DNS, TLS (certificate not trusted, name mismatch, expired), timeout, reset. Read from an
//! error's source chain; shared by the request path (`backend_unreachable`) and the health
//! probes (`last_error` in `GET /admin/backends`).

/// The cause of a failed connection (or exchange) with a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConnectCause {
    Refused,
    Dns,
    /// The certificate chains to no trusted root: self-signed, or from a private CA the pool
    /// does not name in `ca_file`.
    TlsUntrusted,
    /// The certificate is valid but not for the host name in the backend's URL.
    TlsNameMismatch,
    /// The certificate is expired or not yet valid.
    TlsExpired,
    /// Another TLS failure (e.g. `https://` to a plain-HTTP port).
    Tls,
    ConnectTimeout,
    Reset,
    Other,
}

impl ConnectCause {
    pub(crate) fn describe(self) -> &'static str {
        match self {
            ConnectCause::Refused => {
                "connection refused (is the server running and listening on that port?)"
            }
            ConnectCause::Dns => "DNS lookup failed (check the host name)",
            ConnectCause::TlsUntrusted => {
                "TLS: certificate not trusted (self-signed or from an unknown CA: name the CA in pools[].ca_file)"
            }
            ConnectCause::TlsNameMismatch => {
                "TLS: certificate name mismatch (the certificate is not for the host name in the backend's URL)"
            }
            ConnectCause::TlsExpired => "TLS: certificate expired or not yet valid",
            ConnectCause::Tls => {
                "TLS handshake failed (check https vs http, the certificate and pools[].ca_file)"
            }
            ConnectCause::ConnectTimeout => "connect timed out (host unreachable or firewalled?)",
            ConnectCause::Reset => "the connection was closed before a response arrived",
            ConnectCause::Other => "connection failed",
        }
    }
}

/// Name the cause from `e`'s source chain; when nothing in it says more, a failure while
/// `connecting` is `Other`, one after it `Reset`. Returns the cause and the innermost error's
/// own text (the detail an operator can search for).
pub(crate) fn classify(
    e: &(dyn std::error::Error + 'static),
    connecting: bool,
) -> (ConnectCause, String) {
    let mut detail = e.to_string();
    let mut cause = if connecting {
        ConnectCause::Other
    } else {
        ConnectCause::Reset
    };
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = src {
        detail = s.to_string();
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            cause = match io.kind() {
                std::io::ErrorKind::ConnectionRefused => ConnectCause::Refused,
                std::io::ErrorKind::TimedOut => ConnectCause::ConnectTimeout,
                std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::ConnectionAborted
                | std::io::ErrorKind::BrokenPipe
                | std::io::ErrorKind::UnexpectedEof => ConnectCause::Reset,
                _ => cause,
            };
        }
        if let Some(tls) = s.downcast_ref::<rustls::Error>() {
            cause = tls_cause(tls);
        }
        let text = s.to_string();
        if text.contains("dns error") || text.contains("failed to lookup address") {
            cause = ConnectCause::Dns;
        }
        if text.contains("connect timed out") || text.contains("deadline has elapsed") {
            cause = ConnectCause::ConnectTimeout;
        }
        // An I/O error's `source()` skips the error it wraps (tokio-rustls wraps rustls's
        // own error, with the certificate's verdict, in one): walk into it instead.
        src = match s
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => s.source(),
        };
    }
    (cause, detail)
}

fn tls_cause(e: &rustls::Error) -> ConnectCause {
    use rustls::CertificateError as C;
    match e {
        rustls::Error::InvalidCertificate(c) => match c {
            C::UnknownIssuer | C::BadSignature | C::UnknownRevocationStatus => {
                ConnectCause::TlsUntrusted
            }
            C::NotValidForName | C::NotValidForNameContext { .. } => ConnectCause::TlsNameMismatch,
            C::Expired
            | C::ExpiredContext { .. }
            | C::NotValidYet
            | C::NotValidYetContext { .. } => ConnectCause::TlsExpired,
            _ => ConnectCause::Tls,
        },
        _ => ConnectCause::Tls,
    }
}
