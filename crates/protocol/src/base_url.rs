//! What a path that is no route meant: the mistakes a client's base URL makes (a trailing
//! slash, `//`, an `/api` segment, `/v1` twice or not at all), read back to the route the
//! client was after, so that a 404 can open with the fix.

use crate::endpoint;

/// One way a base URL puts a route's path out of shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mistake {
    /// An empty segment: the base URL ends in `/` and the client adds another.
    DoubleSlash,
    /// The path ends in `/`.
    TrailingSlash,
    /// An `/api` segment (`http://host/api`, a habit from other gateways).
    ApiSegment,
    /// `/v1/v1/`: the base URL ends in `/v1` and the client adds its own (Anthropic's clients).
    DoubleV1,
    /// An OpenAI route without `/v1`: the base URL lacks it.
    MissingV1,
}

impl Mistake {
    /// The fix, said first.
    pub fn fix(self) -> &'static str {
        match self {
            Mistake::DoubleSlash => {
                "remove the trailing `/` from the base URL (the path has an empty segment, `//`: the client adds a `/` of its own)"
            }
            Mistake::TrailingSlash => "drop the trailing `/` from the path",
            Mistake::ApiSegment => "remove `/api` from the base URL",
            Mistake::DoubleV1 => {
                "remove one `/v1` (the path has it twice: Anthropic clients such as Claude Code take the base URL without /v1 and add it themselves)"
            }
            Mistake::MissingV1 => "add `/v1` to the end of the base URL (OpenAI clients)",
        }
    }
}

/// The route a client meant: its method and path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub method: &'static str,
    pub path: &'static str,
}

/// The route a path that matched none meant, and each mistake that kept it from matching
/// (in the order they were undone), or `None` when no undoing gives a route.
pub fn meant(path: &str) -> Option<(Vec<Mistake>, Route)> {
    let mut mistakes = Vec::new();
    let mut p = path.to_owned();
    if p.contains("//") {
        let mut collapsed = String::with_capacity(p.len());
        for c in p.chars() {
            if !(c == '/' && collapsed.ends_with('/')) {
                collapsed.push(c);
            }
        }
        p = collapsed;
        mistakes.push(Mistake::DoubleSlash);
    }
    if p.len() > 1 && p.ends_with('/') {
        p.pop();
        mistakes.push(Mistake::TrailingSlash);
    }
    if let Some(found) = row_of(&p) {
        return (!mistakes.is_empty()).then_some((mistakes, found));
    }
    let segments: Vec<&str> = p.split('/').filter(|s| !s.is_empty()).collect();
    let without_api: Vec<&str> = segments.iter().copied().filter(|s| *s != "api").collect();
    if without_api.len() < segments.len() {
        mistakes.push(Mistake::ApiSegment);
    }
    let mut rest = without_api;
    while rest.len() > 1 && rest[0] == "v1" && rest[1] == "v1" {
        rest.remove(0);
        if !mistakes.contains(&Mistake::DoubleV1) {
            mistakes.push(Mistake::DoubleV1);
        }
    }
    let joined = format!("/{}", rest.join("/"));
    if let Some(found) = row_of(&joined) {
        return (!mistakes.is_empty()).then_some((mistakes, found));
    }
    if rest.first() != Some(&"v1")
        && let Some(found) = row_of(&format!("/v1{joined}"))
    {
        mistakes.push(Mistake::MissingV1);
        return Some((mistakes, found));
    }
    None
}

/// The route of a path, `GET /v1/models` included (the router serves it beside the table).
fn row_of(path: &str) -> Option<Route> {
    if path == "/v1/models" {
        return Some(Route {
            method: "GET",
            path: "/v1/models",
        });
    }
    endpoint::lookup(path).map(|f| Route {
        method: f.row.method.as_str(),
        path: f.row.path,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixes(path: &str) -> Option<(Vec<Mistake>, &'static str)> {
        meant(path).map(|(m, route)| (m, route.path))
    }

    #[test]
    fn each_mistake_is_read_back_to_its_route() {
        use Mistake::*;
        assert_eq!(
            fixes("/api/chat/completions"),
            Some((vec![ApiSegment, MissingV1], "/v1/chat/completions"))
        );
        assert_eq!(
            fixes("/api/v1/chat/completions"),
            Some((vec![ApiSegment], "/v1/chat/completions"))
        );
        assert_eq!(
            fixes("/v1/api/embeddings"),
            Some((vec![ApiSegment], "/v1/embeddings"))
        );
        assert_eq!(
            fixes("/v1//chat/completions"),
            Some((vec![DoubleSlash], "/v1/chat/completions"))
        );
        assert_eq!(
            fixes("/v1/chat/completions/"),
            Some((vec![TrailingSlash], "/v1/chat/completions"))
        );
        assert_eq!(
            fixes("/v1/models/"),
            Some((vec![TrailingSlash], "/v1/models"))
        );
        assert_eq!(
            fixes("/v1/v1/messages"),
            Some((vec![DoubleV1], "/v1/messages"))
        );
        assert_eq!(
            fixes("/chat/completions"),
            Some((vec![MissingV1], "/v1/chat/completions"))
        );
        assert_eq!(
            fixes("//api//v1/responses/"),
            Some((
                vec![DoubleSlash, TrailingSlash, ApiSegment],
                "/v1/responses"
            ))
        );
        // A route as it is, or a path near none, has nothing to undo.
        assert_eq!(fixes("/v1/chat/completions"), None);
        assert_eq!(fixes("/v1/engines"), None);
        assert_eq!(fixes("/"), None);
        assert_eq!(fixes("/api"), None);
    }
}
