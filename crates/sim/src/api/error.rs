//! `ApiError`: every error the sim answers with, and the body vLLM (or FastAPI, or vLLM's
//! Anthropic layer) writes for it.

use bytes::Bytes;
use http::StatusCode;
use serde::Serialize;

/// Every error the sim answers with, in the body shape vLLM uses for it.
#[derive(Debug)]
pub(crate) enum ApiError {
    /// `--api-key` set and the request lacks `Authorization: Bearer <key>`.
    Unauthorized,
    /// No such route (FastAPI's body).
    RouteNotFound,
    /// Known route, wrong method (FastAPI's body).
    MethodNotAllowed,
    /// The request names a model this sim does not serve: the model, and the names it does.
    ModelNotFound(String, String),
    /// Bad parameters, prompt too long: vLLM's `BadRequestError`, with the parameter it names.
    BadRequest(String),
    BadParam {
        message: String,
        param: &'static str,
    },
    /// A body FastAPI's validation refuses (malformed JSON, a missing or mistyped field):
    /// type `Bad Request`, `param` the pydantic location (`body.messages`, `body.31`).
    Validation { message: String, loc: String },
    /// Request body over the sim's limit.
    PayloadTooLarge,
    /// `--fail-rate` picked this request.
    InjectedFailure,
    /// Any other OpenAI-shaped error, as vLLM words it.
    Flat {
        status: StatusCode,
        message: String,
        kind: &'static str,
        param: Option<&'static str>,
    },
    /// An error of `/v1/messages` that vLLM's Anthropic layer shapes as Anthropic's
    /// (`{"type":"error","error":{"type":<its error class>,"message"}}`); request validation
    /// and auth keep their own shapes.
    Anthropic(Box<ApiError>),
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorInfo<'a>,
}

#[derive(Serialize)]
struct ErrorInfo<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: u16,
}

impl ApiError {
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::RouteNotFound | ApiError::ModelNotFound(..) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::BadRequest(_) | ApiError::BadParam { .. } | ApiError::Validation { .. } => {
                StatusCode::BAD_REQUEST
            }
            ApiError::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::InjectedFailure => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Flat { status, .. } => *status,
            ApiError::Anthropic(inner) => inner.status(),
        }
    }

    /// This error as `/v1/messages` answers it.
    pub(crate) fn anthropic(self) -> ApiError {
        match self {
            e @ (ApiError::Unauthorized
            | ApiError::Validation { .. }
            | ApiError::RouteNotFound
            | ApiError::MethodNotAllowed) => e,
            e => ApiError::Anthropic(Box::new(e)),
        }
    }

    pub(crate) fn body(&self) -> Bytes {
        let openai = |message: &str, kind: &str, param: Option<&str>| {
            let body = ErrorBody {
                error: ErrorInfo {
                    message,
                    kind,
                    param,
                    code: self.status().as_u16(),
                },
            };
            Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
        };
        match self {
            // vLLM's auth middleware and FastAPI's defaults answer in these bare shapes, not
            // the OpenAI error object; clients in the wild parse exactly these.
            ApiError::Unauthorized => Bytes::from_static(br#"{"error":"Unauthorized"}"#),
            ApiError::RouteNotFound => Bytes::from_static(br#"{"detail":"Not Found"}"#),
            ApiError::MethodNotAllowed => Bytes::from_static(br#"{"detail":"Method Not Allowed"}"#),
            ApiError::ModelNotFound(model, served) => openai(
                &format!("The model `{model}` does not exist. Valid aliases: {served}."),
                "NotFoundError",
                Some("model"),
            ),
            ApiError::BadRequest(msg) => openai(msg, "BadRequestError", None),
            ApiError::BadParam { message, param } => {
                openai(message, "BadRequestError", Some(param))
            }
            ApiError::Validation { message, loc } => openai(message, "Bad Request", Some(loc)),
            ApiError::PayloadTooLarge => openai(
                "Request body too large for the simulator.",
                "BadRequestError",
                None,
            ),
            ApiError::InjectedFailure => openai(
                "Simulated engine failure (--fail-rate)",
                "InternalServerError",
                None,
            ),
            ApiError::Flat {
                message,
                kind,
                param,
                ..
            } => openai(message, kind, *param),
            ApiError::Anthropic(inner) => {
                let v: serde_json::Value =
                    serde_json::from_slice(&inner.body()).unwrap_or_default();
                let body = serde_json::json!({
                    "type": "error",
                    "error": {"type": v["error"]["type"], "message": v["error"]["message"]},
                });
                Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
            }
        }
    }
}
