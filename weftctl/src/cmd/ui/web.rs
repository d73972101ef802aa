//! The page's HTTP server on loopback (axum).
//!
//! - The printed link carries a one-time token. Its first use trades it
//!   for a session cookie (HttpOnly, SameSite=Strict, named after the
//!   port, so two `weftctl ui` on one host keep apart), answered with a
//!   page that moves itself to `/`; any later use is refused, as is every
//!   page request without the session (403).
//! - Only requests naming this server's own address in `Host` are
//!   answered (421 otherwise): a web page elsewhere cannot reach it
//!   through a DNS name rebound to 127.0.0.1.
//! - Every answer forbids framing, inline scripts and outside content.
//! - `/live` streams the page's updates as server-sent events: `tick`
//!   after every reading, `update` (the live part's HTML) when it changed.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Query, Request, State as With};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures::StreamExt;

use super::page;
use super::watch::{Frame, State};

const CSS: &str = include_str!("assets/ui.css");
const JS: &str = include_str!("assets/ui.js");

/// Who may look: the holder of the printed token, once; then the holder
/// of the session it was traded for.
pub struct Auth {
    token: String,
    /// SHA-256 of the token while unused; None once it was used.
    unused: Mutex<Option<String>>,
    /// SHA-256 of the session, once there is one.
    session: Mutex<Option<String>>,
    cookie: String,
    /// The `Host` values this server answers.
    hosts: Vec<String>,
}

fn random_hex() -> Result<String, String> {
    let mut b = [0u8; 32];
    getrandom::getrandom(&mut b).map_err(|e| format!("no randomness for the token: {e}"))?;
    Ok(hex::encode(b))
}

/// Compared as digests: the time a comparison takes tells nothing of the secret.
fn digest(s: &str) -> String {
    weft_common::sha256_hex(s)
}

impl Auth {
    pub fn new(addr: SocketAddr) -> Result<Auth, String> {
        let token = random_hex()?;
        let port = addr.port();
        let mut hosts = vec![super::host_port(addr), format!("localhost:{port}")];
        // Browsers leave the default port out of Host.
        if port == 80 {
            hosts.extend([
                super::host_port(addr).trim_end_matches(":80").to_string(),
                "localhost".into(),
            ]);
        }
        Ok(Auth {
            unused: Mutex::new(Some(digest(&token))),
            token,
            session: Mutex::new(None),
            cookie: format!("weft_ui_{port}"),
            hosts,
        })
    }

    pub fn token(&self) -> &str {
        &self.token
    }

    /// The token, if it is the printed one and unused: a new session.
    fn redeem(&self, token: &str) -> Option<String> {
        let mut unused = self.unused.lock().unwrap();
        if unused.as_deref() != Some(digest(token).as_str()) {
            return None;
        }
        let session = random_hex().ok()?;
        *unused = None;
        *self.session.lock().unwrap() = Some(digest(&session));
        Some(session)
    }

    fn has_session(&self, headers: &HeaderMap) -> bool {
        let Some(want) = self.session.lock().unwrap().clone() else {
            return false;
        };
        headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|kv| kv.trim().split_once('='))
            .any(|(k, v)| k == self.cookie && digest(v) == want)
    }
}

#[derive(Clone)]
struct App {
    auth: Arc<Auth>,
    state: State,
}

pub async fn serve(listener: tokio::net::TcpListener, auth: Auth, state: State) -> std::io::Result<()> {
    let app = App {
        auth: Arc::new(auth),
        state,
    };
    let router = Router::new()
        .route("/", get(index))
        .route("/live", get(live))
        .route("/ui.css", get(|| async { asset("text/css; charset=utf-8", CSS) }))
        .route("/ui.js", get(|| async { asset("text/javascript; charset=utf-8", JS) }))
        .fallback(|| async { (StatusCode::NOT_FOUND, "not found: the page is at /") })
        .layer(middleware::from_fn_with_state(app.clone(), guard))
        .with_state(app);
    axum::serve(listener, router).await
}

fn asset(kind: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, kind)], body).into_response()
}

/// The `Host` check, and the headers every answer carries.
async fn guard(With(app): With<App>, req: Request, next: Next) -> Response {
    let host = req.headers().get(header::HOST).and_then(|h| h.to_str().ok());
    let mut r = if host.is_some_and(|h| app.auth.hosts.iter().any(|a| a == h)) {
        next.run(req).await
    } else {
        let msg = format!("weftctl ui answers only at http://{}/", app.auth.hosts[0]);
        (StatusCode::MISDIRECTED_REQUEST, msg).into_response()
    };
    let h = r.headers_mut();
    let fixed = [
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; \
             base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        ),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::X_FRAME_OPTIONS, "DENY"),
        // The link's token stays out of whatever the page links to.
        (header::REFERRER_POLICY, "no-referrer"),
        (header::CACHE_CONTROL, "no-store"),
    ];
    for (k, v) in fixed {
        h.insert(k, HeaderValue::from_static(v));
    }
    r
}

fn refused(why: &str) -> Response {
    let body = page::refused(why).into_string();
    (
        StatusCode::FORBIDDEN,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        body,
    )
        .into_response()
}

async fn index(With(app): With<App>, Query(q): Query<HashMap<String, String>>, headers: HeaderMap) -> Response {
    let auth = &app.auth;
    if let Some(token) = q.get("token") {
        if auth.has_session(&headers) {
            return (StatusCode::SEE_OTHER, [(header::LOCATION, "/")]).into_response();
        }
        let Some(session) = auth.redeem(token) else {
            return refused("This link was used already, or it is not the one weftctl ui printed.");
        };
        // Not a redirect: a link followed from another site's page (a chat,
        // a web terminal) makes the whole redirect chain cross-site, and the
        // browser would withhold the SameSite=Strict cookie from `/` after
        // the token was spent. This page's own move to `/` is same-site.
        let cookie = format!("{}={session}; Path=/; HttpOnly; SameSite=Strict", auth.cookie);
        return (
            [
                (header::CONTENT_TYPE, "text/html; charset=utf-8".to_string()),
                (header::SET_COOKIE, cookie),
            ],
            page::entering().into_string(),
        )
            .into_response();
    }
    if !auth.has_session(&headers) {
        return refused("This page needs the link weftctl ui printed.");
    }
    let frame = app.state.frames().borrow().clone();
    let body = page::document(&frame).into_string();
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], body).into_response()
}

/// The page's updates: `tick` after every reading, `update` when the live
/// part changed (and once at the start, in case it changed since the
/// page was served).
async fn live(With(app): With<App>, headers: HeaderMap) -> Response {
    if !app.auth.has_session(&headers) {
        return refused("This page needs the link weftctl ui printed.");
    }
    let rx = app.state.frames();
    let events = futures::stream::unfold((rx, None::<Arc<Frame>>), |(mut rx, last)| async move {
        if last.is_some() {
            rx.changed().await.ok()?;
        }
        let f = rx.borrow_and_update().clone();
        let mut out = vec![Ok::<_, Infallible>(
            Event::default().event("tick").data(one_line(&f.clock)),
        )];
        if last.as_ref().is_none_or(|l| l.live != f.live) {
            out.push(Ok(Event::default().event("update").data(f.live.replace('\r', ""))));
        }
        Some((futures::stream::iter(out), (rx, Some(f))))
    })
    .flatten();
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

fn one_line(s: &str) -> String {
    s.replace(['\r', '\n'], " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cookie(a: &Auth, v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::COOKIE, format!("other=1; {}={v}", a.cookie).parse().unwrap());
        h
    }

    #[test]
    fn the_token_works_once_and_only_the_session_it_made_is_let_in() {
        let a = Auth::new("127.0.0.1:8080".parse().unwrap()).unwrap();
        assert_eq!(a.hosts, ["127.0.0.1:8080", "localhost:8080"]);
        let on_80 = Auth::new("127.0.0.1:80".parse().unwrap()).unwrap();
        assert!(
            on_80.hosts.iter().any(|h| h == "127.0.0.1"),
            "browsers leave port 80 out"
        );
        assert!(!a.has_session(&HeaderMap::new()), "no session before the token");
        assert!(a.redeem("wrong").is_none(), "a wrong token makes no session");
        let token = a.token().to_string();
        let s = a.redeem(&token).expect("the printed token");
        assert!(a.redeem(&token).is_none(), "the token is spent");
        assert!(a.has_session(&cookie(&a, &s)));
        assert!(!a.has_session(&cookie(&a, "forged")));
        assert!(!a.has_session(&cookie(&a, "")));
    }
}
