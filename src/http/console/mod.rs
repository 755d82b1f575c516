//! The web console at `/` on the HTTP port: server-rendered pages over the cluster, built
//! as a client of it. Every page talks to the cluster through the Rust client library at
//! this process's own client listener, so the console sees and is refused exactly what
//! any client would be, and works on every role (a controller's console reaches brokers
//! through the cluster's metadata).
//!
//! - [`cluster`]: the overview (controllers, brokers, partition health);
//! - [`topics`]: list, search, create, delete, and a topic's partitions and configs;
//! - [`messages`]: the message browser and the test-record form;
//! - [`groups`]: groups, members, lag, and resetting an empty group's offsets.
//!
//! Safety: maud escapes every interpolated string; a Content-Security-Policy allows only
//! the console's own script and style (so even an escaping bug could not run a record as
//! script); every mutating action is a POST carrying a CSRF token ([`csrf`]).

mod cluster;
pub mod csrf;
mod groups;
mod messages;
pub mod render;
mod topics;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;
use maud::{html, Markup};

use crate::client::admin::AdminClient;
use crate::client::error::ClientError;
use csrf::CsrfKey;

/// How long one call of a page to the cluster may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

const STYLE: &str = include_str!("static/console.css");
const SCRIPT: &str = include_str!("static/console.js");

/// Only the console's own files; no inline script, no framing, forms post only here.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
    style-src 'self'; img-src 'self'; connect-src 'self'; form-action 'self'; \
    frame-ancestors 'none'; base-uri 'none'";

/// What the console's handlers share.
#[derive(Clone)]
pub struct Console {
    inner: Arc<Inner>,
}

struct Inner {
    /// This process's client listener, if it serves one.
    client_address: Option<String>,
    /// Whether this process is a broker (else brokers are found through the cluster).
    broker: bool,
    key: CsrfKey,
}

impl Console {
    /// A console reaching the cluster at `client_address` (this process's client
    /// listener; an unspecified host is reached on loopback).
    pub fn new(client_address: Option<SocketAddr>, broker: bool) -> Self {
        let client_address = client_address.map(|mut a| {
            if a.ip().is_unspecified() {
                a.set_ip(match a {
                    SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                    SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
                });
            }
            a.to_string()
        });
        Self {
            inner: Arc::new(Inner {
                client_address,
                broker,
                key: CsrfKey::random(),
            }),
        }
    }

    /// Where admin calls go (any node serves them).
    fn admin_bootstrap(&self) -> Result<Vec<String>, ClientError> {
        self.inner
            .client_address
            .clone()
            .map(|a| vec![a])
            .ok_or_else(|| {
                ClientError::new(
                    crate::error_code::ErrorCode::InvalidRequest,
                    "this process serves no client listener for the console to use",
                )
            })
    }

    /// An admin client.
    fn admin(&self) -> Result<AdminClient, ClientError> {
        Ok(AdminClient::new(self.admin_bootstrap()?, CALL_TIMEOUT))
    }

    /// Where produce, fetch and group calls go: this broker, or the cluster's live
    /// brokers when this process is only a controller.
    async fn data_bootstrap(&self) -> Result<Vec<String>, ClientError> {
        let own = self.admin_bootstrap()?;
        if self.inner.broker {
            return Ok(own);
        }
        let cluster = self.admin()?.describe_cluster().await?;
        let brokers: Vec<String> = cluster
            .brokers
            .iter()
            .filter_map(|b| b.broker.as_ref())
            .filter(|b| b.state == "unfenced")
            .map(|b| b.address.clone())
            .collect();
        if brokers.is_empty() {
            return Err(ClientError::new(
                crate::error_code::ErrorCode::ClusterNotReady,
                "no broker is registered and unfenced",
            ));
        }
        Ok(brokers)
    }
}

/// The console's routes.
pub fn router(console: Console) -> Router {
    Router::new()
        .route("/", get(cluster::overview))
        .route("/topics", get(topics::list).post(topics::create))
        .route("/topics/{topic}", get(topics::show))
        .route(
            "/topics/{topic}/delete",
            get(topics::confirm_delete).post(topics::delete),
        )
        .route(
            "/topics/{topic}/messages",
            get(messages::browse).post(messages::produce),
        )
        .route("/groups", get(groups::list))
        .route("/groups/{group}", get(groups::show))
        .route(
            "/groups/{group}/reset-offsets",
            axum::routing::post(groups::reset),
        )
        .route(
            "/static/console.css",
            get(|| async { static_file("text/css", STYLE) }),
        )
        .route(
            "/static/console.js",
            get(|| async { static_file("text/javascript", SCRIPT) }),
        )
        .layer(axum::middleware::map_response(security_headers))
        .with_state(console)
}

fn static_file(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        body,
    )
        .into_response()
}

async fn security_headers(mut response: Response) -> Response {
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    response
}

/// The browser a request comes from: its id (from the console cookie, or new) and the
/// CSRF token its forms carry.
pub struct Browser {
    id: String,
    fresh: bool,
    token: String,
}

impl FromRequestParts<Console> for Browser {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        console: &Console,
    ) -> Result<Self, Self::Rejection> {
        let existing = parts
            .headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .find_map(csrf::browser_id_from_cookies)
            .map(str::to_owned);
        let (id, fresh) = match existing {
            Some(id) => (id, false),
            None => (csrf::new_browser_id(), true),
        };
        let token = console.inner.key.token(&id);
        Ok(Browser { id, fresh, token })
    }
}

impl Browser {
    /// A page, giving a new browser its cookie.
    fn page(&self, status: StatusCode, markup: Markup) -> Response {
        let mut response = (status, markup).into_response();
        if self.fresh {
            if let Ok(v) = HeaderValue::from_str(&csrf::set_cookie(&self.id)) {
                response.headers_mut().insert(header::SET_COOKIE, v);
            }
        }
        response
            .headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        response
    }

    /// The 403 page for a form whose token does not belong to this browser (a fresh
    /// browser has sent none); `None` when the token is good.
    fn refusal(&self, console: &Console, form_token: Option<&str>) -> Option<Response> {
        match form_token {
            Some(t) if !self.fresh && console.inner.key.verify(&self.id, t) => None,
            _ => Some(self.page(
                StatusCode::FORBIDDEN,
                render::page(
                    render::Section::Overview,
                    "Form refused",
                    html! {
                        div.error role="alert" {
                            "This form was not sent from this console page in this browser "
                            "session (a missing or stale CSRF token). Nothing was changed. "
                            "Go back, reload the page and send it again."
                        }
                    },
                ),
            )),
        }
    }
}

/// Where a successful POST sends the browser (Post/Redirect/Get).
fn see_other(location: &str) -> Response {
    Redirect::to(location).into_response()
}

/// A failed call as a page status: the client's mistakes 4xx, the cluster's 5xx.
fn status_of(error: &ClientError) -> StatusCode {
    use crate::error_code::ErrorCode as C;
    match error.code {
        C::UnknownTopicOrPartition | C::GroupIdNotFound => StatusCode::NOT_FOUND,
        C::TopicAlreadyExists => StatusCode::CONFLICT,
        _ if error.is_retriable() => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::BAD_REQUEST,
    }
}
