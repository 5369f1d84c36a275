//! The audio routes' `multipart/form-data` body: the `model` form field (its bytes' span, for
//! a rename), `stream`, and the presence of `file`. The audio itself is the backend's.

use std::borrow::Cow;
use std::ops::Range;

use bytes::Bytes;

use super::{GenerationFields, RequestView, ViewError, invalid, short};
use crate::Endpoint;

/// A `multipart/form-data` body (the audio routes): the `model` form field (its bytes' span,
/// for a rename), `stream`, and the presence of `file`. The audio itself is the backend's.
pub async fn parse<'a>(
    body: &'a Bytes,
    content_type: &str,
    endpoint: Endpoint,
) -> Result<RequestView<'a>, ViewError> {
    let path = endpoint.path();
    // A parameter named twice is read differently by different parsers (the first
    // `boundary` here, the last in Starlette, vLLM's): the backend would read another body.
    if let Some(name) = repeated_parameter(content_type) {
        return Err(ViewError::InvalidRequest {
            param: None,
            message: format!(
                "The Content-Type names its `{name}` parameter more than once; send it once (`multipart/form-data; boundary=...`)."
            ),
        });
    }
    let Ok(boundary) = multer::parse_boundary(content_type) else {
        return Err(ViewError::InvalidRequest {
            param: None,
            message: format!(
                "{path} takes `multipart/form-data` (an audio `file` and a `model` field, e.g. curl -F file=@speech.wav -F model=...); got `Content-Type: {content_type}`."
            ),
        });
    };
    let whole = body.clone();
    let stream =
        futures_util::stream::once(async move { Ok::<Bytes, std::convert::Infallible>(whole) });
    let mut form = multer::Multipart::new(stream, boundary.clone());
    let malformed = |e: multer::Error| ViewError::InvalidRequest {
        param: None,
        message: format!("The multipart/form-data body cannot be read: {e}."),
    };
    let (mut model, mut stream_flag, mut file) = (None, None, false);
    // A field the gateway reads, given twice, is read differently by different parsers (the
    // backend's takes the last): it is refused, not guessed.
    let twice = |name: &'static str| {
        invalid(
            name,
            format!("The form field `{name}` is given more than once on {path}; send it once."),
        )
    };
    while let Some(field) = form.next_field().await.map_err(malformed)? {
        match field.name() {
            Some("model") if model.is_some() => return Err(twice("model")),
            Some("stream") if stream_flag.is_some() => return Err(twice("stream")),
            Some("model") => model = Some(field.text().await.map_err(malformed)?),
            Some("stream") => stream_flag = Some(field.text().await.map_err(malformed)?),
            // The audio is not read here: it goes to the backend as it came.
            Some("file") => file = true,
            _ => {}
        }
    }
    let model = model.map(|m| m.trim().to_owned()).unwrap_or_default();
    if model.is_empty() {
        return Err(invalid(
            "model",
            format!(
                "`model` is required on {path}: a form field naming one of the models listed by GET /v1/models (curl -F model=...)."
            ),
        ));
    }
    if !file {
        return Err(invalid(
            "file",
            format!(
                "`file` is required on {path}: the audio, as a multipart file field (curl -F file=@speech.wav)."
            ),
        ));
    }
    let stream = match stream_flag.as_deref().map(str::trim) {
        None | Some("false" | "False" | "0") => false,
        Some("true" | "True" | "1") => true,
        Some(other) => {
            return Err(invalid(
                "stream",
                format!("`stream` must be true or false, got `{}`.", short(other)),
            ));
        }
    };
    // The field's bytes are found as `name="model"` (the form every client writes); a part
    // named otherwise (unquoted, escaped) is refused rather than forwarded unchecked.
    let unlocatable = || {
        invalid(
            "model",
            format!(
                "The `model` form field on {path} must be named as `Content-Disposition: form-data; name=\"model\"` with its value as plain text."
            ),
        )
    };
    let model_span =
        form_field_span(body, boundary.as_bytes(), b"model").ok_or_else(unlocatable)?;
    if body[model_span.clone()].trim_ascii() != model.as_bytes() {
        return Err(unlocatable());
    }
    Ok(RequestView {
        model: Cow::Owned(model),
        model_span,
        ..RequestView::whole(GenerationFields {
            stream,
            ..GenerationFields::NONE
        })
    })
}

/// The first parameter of a `Content-Type` value named more than once (names compare
/// without case; values may be quoted strings, with `;` and escapes inside).
pub(super) fn repeated_parameter(content_type: &str) -> Option<String> {
    let bytes = content_type.as_bytes();
    let mut names: Vec<String> = Vec::new();
    let mut i = memchr::memchr(b';', bytes)?;
    while i < bytes.len() {
        // At a `;`: the parameter's name runs to `=` (or the next `;`).
        i += 1;
        let start = i;
        while i < bytes.len() && bytes[i] != b'=' && bytes[i] != b';' {
            i += 1;
        }
        let name = content_type[start..i].trim().to_ascii_lowercase();
        if i < bytes.len() && bytes[i] == b'=' {
            i += 1;
            while i < bytes.len() && bytes[i] == b' ' {
                i += 1;
            }
            if i < bytes.len() && bytes[i] == b'"' {
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            while i < bytes.len() && bytes[i] != b';' {
                i += 1;
            }
        }
        if name.is_empty() {
            continue;
        }
        if names.contains(&name) {
            return Some(name);
        }
        names.push(name);
    }
    None
}

/// Where the value of form field `name` is in a multipart body with `boundary`.
fn form_field_span(body: &[u8], boundary: &[u8], name: &[u8]) -> Option<Range<usize>> {
    let mut delimiter = Vec::with_capacity(boundary.len() + 4);
    delimiter.extend_from_slice(b"\r\n--");
    delimiter.extend_from_slice(boundary);
    let mut quoted = Vec::with_capacity(name.len() + 7);
    quoted.extend_from_slice(b"name=\"");
    quoted.extend_from_slice(name);
    quoted.push(b'"');
    // The first delimiter may open the body without the line break before it.
    let mut at = memchr::memmem::find(body, &delimiter[2..])? + delimiter.len() - 2;
    loop {
        let headers_end = at + memchr::memmem::find(&body[at..], b"\r\n\r\n")?;
        let start = headers_end + 4;
        let end = start + memchr::memmem::find(&body[start..], &delimiter)?;
        let headers = &body[at..headers_end];
        // `name="model"`, not `filename="model"`.
        let named = memchr::memmem::find_iter(headers, &quoted)
            .any(|p| p == 0 || matches!(headers[p - 1], b' ' | b';' | b'\t'));
        if named {
            return Some(start..end);
        }
        at = end + delimiter.len();
    }
}
