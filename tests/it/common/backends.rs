//! Backends on 127.0.0.1:0: the sim, stubs that answer what a test says, and one that keeps
//! every request head it gets.

use super::*;

/// A sim on a free port with small, realistic delays unless `f` changes them.
pub async fn sim(f: impl FnOnce(&mut SimArgs)) -> SimServer {
    let mut args = SimArgs {
        decode_step_ms: 2.0,
        decode_ms_per_seq: 0.0,
        prefill_us_per_token: 0.0,
        capture_streams: true,
        ..SimArgs::default()
    };
    f(&mut args);
    fleetgate_sim::start(args).await.expect("sim starts")
}

/// A port nothing listens on.
pub async fn closed_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap()
}

/// A backend that is not the sim (a load balancer's error page, a server without vLLM's
/// routes): every request is answered by `answer(path)` = (status, content type, body).
/// Returns its address and its task (abort it when done).
pub async fn stub_backend(
    answer: fn(&str) -> (u16, &'static str, &'static [u8]),
) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    http_backend(move |req| {
        let (status, content_type, body) = answer(req.uri().path());
        async move {
            http::Response::builder()
                .status(status)
                .header("content-type", content_type)
                .body(http_body_util::Full::new(Bytes::from_static(body)))
                .unwrap()
        }
    })
    .await
}

/// A plain HTTP/1.1 backend on a free port: every request is answered by `answer`. Returns its
/// address and its task (abort it when done).
pub async fn http_backend<F, Fut, B>(answer: F) -> (SocketAddr, tokio::task::JoinHandle<()>)
where
    F: Fn(http::Request<hyper::body::Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = http::Response<B>> + Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    http_backend_on(TcpListener::bind("127.0.0.1:0").await.unwrap(), answer)
}

/// `http_backend` on a listener bound by the caller (a fixed port another process sends to).
pub fn http_backend_on<F, Fut, B>(
    listener: TcpListener,
    answer: F,
) -> (SocketAddr, tokio::task::JoinHandle<()>)
where
    F: Fn(http::Request<hyper::body::Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = http::Response<B>> + Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let answer = answer.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| {
                    let answer = answer(req);
                    async move { Ok::<_, std::convert::Infallible>(answer.await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, server)
}

/// A backend that keeps the head of every request it gets and answers each with a small chat
/// completion whose response head carries `extra` headers as they are.
pub struct HeadRecorder {
    pub addr: SocketAddr,
    pub heads: Arc<Mutex<Vec<HeaderMap>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for HeadRecorder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl HeadRecorder {
    pub async fn start(extra: &'static [(&'static str, &'static str)]) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let heads = Arc::new(Mutex::new(Vec::new()));
        let seen = heads.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let seen = seen.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(
                        move |req: http::Request<hyper::body::Incoming>| {
                            // The gateway's health probes (every 200 ms in tests) are not the
                            // requests under test: a probe landing between two of them must
                            // not be read as one.
                            if req.uri().path() != "/health" {
                                seen.lock().unwrap().push(req.headers().clone());
                            }
                            async move {
                                let mut resp = http::Response::builder()
                                    .status(200)
                                    .header("content-type", "application/json");
                                for (k, v) in extra {
                                    resp = resp.header(*k, *v);
                                }
                                Ok::<_, std::convert::Infallible>(
                                    resp.body(http_body_util::Full::new(Bytes::from_static(
                                        br#"{"id":"c","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#,
                                    )))
                                    .unwrap(),
                                )
                            }
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Self { addr, heads, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The heads received so far, health probes left out.
    pub fn heads(&self) -> Vec<HeaderMap> {
        self.heads.lock().unwrap().clone()
    }
}
