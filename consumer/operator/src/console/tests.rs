//! The console's access rules through its router (`tower::ServiceExt::oneshot`), against a real
//! PostgreSQL (`DATABASE_URL`) where a test reads or acts: nothing is served without a session,
//! a wrong password is refused, the session cookie is HttpOnly and SameSite=Strict, every
//! response carries the security headers, a POST without the session's CSRF token and a
//! viewer's action are refused with 403 before anything is read, bad input is a 4xx with a
//! message, and a database that does not answer is a 503 that says so.

use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use axum::Router;
use clap::Parser;
use consumer::Groups;
use http_body_util::BodyExt;
use pipeline_testkit::db::{database_url, drop_database, migrated_database, server_url};
use sha2::{Digest, Sha256};
use tower::ServiceExt;

use super::users::{hash_password, Role, Users};
use super::{Console, ConsoleSettings};
use crate::args::TargetArgs;
use crate::targets::Targets;

const OPERATOR_PASSWORD: &str = "correct horse battery staple";
const VIEWER_TOKEN: &str = "viewer-token-0123456789abcdef0123456789";

fn users() -> Users {
    let viewer_hash: String = Sha256::digest(VIEWER_TOKEN.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let operator_hash = hash_password(OPERATOR_PASSWORD).expect("hash");
    Users::parse(&format!(
        "# users\nada:operator:{operator_hash}\nvic:viewer:sha256:{viewer_hash}\n"
    ))
    .expect("users")
}

/// The targets alone, as the command line reads them.
#[derive(clap::Parser)]
struct TargetsOnly {
    #[command(flatten)]
    targets: TargetArgs,
}

fn console(database_url: &str) -> Console {
    console_with(database_url, &[])
}

/// A console with more of the command line's target arguments (`--group …`).
fn console_with(database_url: &str, more: &[&str]) -> Console {
    console_at(database_url, more, "")
}

/// A console under `prefix`, with more of the command line's target arguments.
fn console_at(database_url: &str, more: &[&str], prefix: &str) -> Console {
    let args = TargetsOnly::try_parse_from(
        ["pipeline", "--database-url", database_url]
            .iter()
            .chain(more),
    )
    .expect("arguments");
    let settings = ConsoleSettings {
        prefix: prefix.to_owned(),
        ..ConsoleSettings::default()
    };
    Console::new(
        Targets::new(args.targets, &Groups::new()),
        Groups::new(),
        users(),
        settings,
    )
    .expect("settings")
}

/// A console whose database does not answer (nothing listens on port 9).
fn offline() -> Router {
    console("postgres://nobody@127.0.0.1:9/none?sslmode=disable&connect_timeout=1").router()
}

struct Reply {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    body: String,
}

async fn send(router: &Router, request: Request<Body>) -> Reply {
    let response = router.clone().oneshot(request).await.expect("response");
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    Reply {
        status,
        headers,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

fn get(path: &str, cookie: Option<&str>) -> Request<Body> {
    let mut r = Request::get(path);
    if let Some(c) = cookie {
        r = r.header(header::COOKIE, c);
    }
    r.body(Body::empty()).expect("request")
}

fn post(path: &str, cookie: Option<&str>, form: &[(&str, &str)]) -> Request<Body> {
    let body = form
        .iter()
        .map(|(k, v)| format!("{k}={}", super::urls::url_encode(v).replace('/', "%2F")))
        .collect::<Vec<_>>()
        .join("&");
    let mut r =
        Request::post(path).header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
    if let Some(c) = cookie {
        r = r.header(header::COOKIE, c);
    }
    r.body(Body::from(body)).expect("request")
}

/// Logs in; returns the cookie to send and the session's CSRF token (read from a page's form).
async fn login(router: &Router, user: &str, password: &str) -> (String, String) {
    login_at(router, "", user, password).await
}

/// Logs in to a console under `prefix`, back to its timeline page; the cookie's `Path` is the
/// prefix.
async fn login_at(router: &Router, prefix: &str, user: &str, password: &str) -> (String, String) {
    let timeline = format!("{prefix}/timeline");
    let reply = send(
        router,
        post(
            &format!("{prefix}/login"),
            None,
            &[("user", user), ("password", password), ("next", &timeline)],
        ),
    )
    .await;
    assert_eq!(reply.status, StatusCode::SEE_OTHER, "{}", reply.body);
    assert_eq!(reply.headers[header::LOCATION], timeline.as_str());
    let set = reply.headers[header::SET_COOKIE]
        .to_str()
        .expect("cookie")
        .to_owned();
    assert!(set.contains("HttpOnly"), "{set}");
    assert!(set.contains("SameSite=Strict"), "{set}");
    let path = if prefix.is_empty() { "/" } else { prefix };
    assert!(set.contains(&format!("; Path={path};")), "{set}");
    let cookie = set.split(';').next().expect("pair").to_owned();
    let page = send(router, get(&timeline, Some(&cookie))).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    let csrf = page
        .body
        .split(r#"name="csrf" value=""#)
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("a CSRF field")
        .to_owned();
    // The session id never appears in a page.
    let id = cookie.split('=').nth(1).expect("id");
    assert!(!page.body.contains(id));
    (cookie, csrf)
}

fn assert_security_headers(reply: &Reply) {
    let h = &reply.headers;
    assert_eq!(
        h[header::CONTENT_SECURITY_POLICY],
        "default-src 'self'; script-src 'self'; object-src 'none'; frame-ancestors 'none'; \
         base-uri 'none'; form-action 'self'"
    );
    assert_eq!(h[header::X_FRAME_OPTIONS], "DENY");
    assert_eq!(h[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
    assert_eq!(h[header::REFERRER_POLICY], "no-referrer");
}

#[test]
fn users_parse_and_verify_argon2_and_sha256() {
    let users = users();
    assert_eq!(users.len(), 2);
    assert_eq!(users.verify("ada", OPERATOR_PASSWORD), Some(Role::Operator));
    assert_eq!(users.verify("ada", "wrong"), None);
    assert_eq!(users.verify("vic", VIEWER_TOKEN), Some(Role::Viewer));
    assert_eq!(users.verify("vic", "viewer-token"), None);
    assert_eq!(users.verify("nobody", OPERATOR_PASSWORD), None);
    // Hashes never show in Debug output.
    let shown = format!("{users:?}");
    assert!(
        !shown.contains("argon2") && !shown.contains("sha256"),
        "{shown}"
    );
}

#[test]
fn bad_user_lines_are_refused_without_showing_the_hash() {
    for (line, expected) in [
        ("ada:admin:sha256:00", "neither viewer nor operator"),
        ("ada:operator", "not name:role:hash"),
        ("ada:operator:plaintext-secret", "not an Argon2 PHC string"),
        ("ada:operator:sha256:abcd", "64 hex digits"),
        (":viewer:sha256:abcd", "user name"),
    ] {
        let e = Users::parse(line).expect_err(line);
        let message = format!("{e:#}");
        assert!(message.contains(expected), "{line}: {message}");
        assert!(!message.contains("plaintext-secret"), "{message}");
    }
    let twice = "a:viewer:sha256:".to_owned() + &"0".repeat(64);
    let e = Users::parse(&format!("{twice}\n{twice}")).expect_err("twice");
    assert!(format!("{e}").contains("twice"), "{e}");
    assert!(
        Users::load(None, None).is_err(),
        "no user at all is refused"
    );
}

#[tokio::test]
async fn nothing_is_served_without_a_session_and_every_response_has_the_headers() {
    let router = offline();
    for path in [
        "/",
        "/timeline?id=x",
        "/dead-letters",
        "/outbox",
        "/groups",
        "/nope",
    ] {
        let reply = send(&router, get(path, None)).await;
        assert_eq!(reply.status, StatusCode::SEE_OTHER, "{path}");
        assert!(
            reply.headers[header::LOCATION]
                .to_str()
                .expect("location")
                .starts_with("/login?next="),
            "{path}"
        );
        assert_security_headers(&reply);
    }
    for path in [
        "/api/overview",
        "/api/timeline?id=x",
        "/api/dead-letters",
        "/api/outbox",
    ] {
        let reply = send(&router, get(path, None)).await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{path}");
        assert_security_headers(&reply);
    }
    let forged = send(&router, get("/", Some("pipeline_console=0123456789abcdef"))).await;
    assert_eq!(forged.status, StatusCode::SEE_OTHER);
    let action = send(&router, post("/actions/requeue", None, &[("event", "x")])).await;
    assert_eq!(action.status, StatusCode::UNAUTHORIZED);
    let login = send(&router, get("/login", None)).await;
    assert_eq!(login.status, StatusCode::OK);
    assert_security_headers(&login);
    assert!(!login.body.contains("<script>"), "no inline script");
    let js = send(&router, get("/static/console.js", None)).await;
    assert_eq!(js.status, StatusCode::OK);
    assert!(js.headers[header::CONTENT_TYPE]
        .to_str()
        .expect("type")
        .starts_with("text/javascript"));
}

#[tokio::test]
async fn a_wrong_password_is_refused_after_a_delay() {
    let router = offline();
    let started = std::time::Instant::now();
    let reply = send(
        &router,
        post("/login", None, &[("user", "ada"), ("password", "guess")]),
    )
    .await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    assert!(
        reply.body.contains("Wrong user name or password"),
        "{}",
        reply.body
    );
    assert!(!reply.body.contains("guess"), "the password is not echoed");
    assert!(reply.headers.get(header::SET_COOKIE).is_none());
    assert!(started.elapsed() >= Duration::from_millis(500));
    let unknown = send(
        &router,
        post("/login", None, &[("user", "mallory"), ("password", "x")]),
    )
    .await;
    assert_eq!(unknown.status, StatusCode::UNAUTHORIZED);
    // An open redirect is not followed: `next` stays on this console.
    let reply = send(
        &router,
        post(
            "/login",
            None,
            &[
                ("user", "vic"),
                ("password", VIEWER_TOKEN),
                ("next", "//evil.example/"),
            ],
        ),
    )
    .await;
    assert_eq!(reply.headers[header::LOCATION], "/");
}

#[test]
fn an_unknown_user_name_costs_the_same_password_check_as_a_known_one() {
    let users = users();
    let fastest = |name: &str| {
        (0..3)
            .map(|_| {
                let started = std::time::Instant::now();
                assert_eq!(users.verify(name, "a wrong guess"), None);
                started.elapsed()
            })
            .min()
            .expect("three timings")
    };
    let (known, unknown) = (fastest("ada"), fastest("mallory"));
    // Both run Argon2: a refusal's time does not tell which names exist.
    assert!(unknown * 2 >= known, "known {known:?}, unknown {unknown:?}");
}

/// A login form from client `address`, as the served console sees it.
fn login_from(address: &str, user: &str, password: &str) -> Request<Body> {
    let mut request = post("/login", None, &[("user", user), ("password", password)]);
    let address: std::net::SocketAddr = address.parse().expect("address");
    let _ = request
        .extensions_mut()
        .insert(axum::extract::ConnectInfo(address));
    request
}

#[tokio::test]
async fn login_attempts_are_throttled_per_address_and_per_user_name() {
    let router = offline();
    // Guesses at one user's password from many addresses: a burst, then 429s that say when to
    // come back, and never a session.
    let guesses = futures::future::join_all((0..30).map(|i| {
        let router = router.clone();
        async move {
            send(
                &router,
                login_from(&format!("198.51.100.{i}:4000"), "ada", "guess"),
            )
            .await
        }
    }))
    .await;
    let refused = guesses
        .iter()
        .filter(|r| r.status == StatusCode::UNAUTHORIZED)
        .count();
    let throttled: Vec<&Reply> = guesses
        .iter()
        .filter(|r| r.status == StatusCode::TOO_MANY_REQUESTS)
        .collect();
    assert_eq!((refused, throttled.len()), (10, 20));
    for reply in &throttled {
        assert!(reply.headers.get(header::SET_COOKIE).is_none());
        let wait: u64 = reply.headers[header::RETRY_AFTER]
            .to_str()
            .expect("ascii")
            .parse()
            .expect("seconds");
        assert!((1..=60).contains(&wait), "{wait}");
        assert!(
            reply.body.contains("Too many login attempts"),
            "{}",
            reply.body
        );
    }
    // Guesses of many names from one address: the address is held back.
    let names = futures::future::join_all((0..10).map(|i| {
        let router = router.clone();
        async move {
            send(
                &router,
                login_from("192.0.2.7:4000", &format!("user{i}"), "x"),
            )
            .await
        }
    }))
    .await;
    assert!(names.iter().all(|r| r.status == StatusCode::UNAUTHORIZED));
    let reply = send(&router, login_from("192.0.2.7:4000", "vic", VIEWER_TOKEN)).await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    // Another user, from another address, logs in meanwhile.
    let reply = send(&router, login_from("203.0.113.5:4000", "vic", VIEWER_TOKEN)).await;
    assert_eq!(reply.status, StatusCode::SEE_OTHER, "{}", reply.body);
}

#[tokio::test]
async fn no_answer_shows_the_database_password_wherever_the_url_carries_it() {
    let router = console(
        "postgres://nobody:hunter2-userinfo@127.0.0.1:9/none?sslmode=disable&connect_timeout=1\
         &password=hunter2-query",
    )
    .router();
    let (cookie, _) = login(&router, "vic", VIEWER_TOKEN).await;
    // The pages that read the database answer once it has not answered (the pool's wait).
    let paths = ["/api/groups", "/dead-letters?group=no-such-group"];
    let replies = futures::future::join_all(
        paths
            .iter()
            .map(|path| send(&router, get(path, Some(&cookie)))),
    )
    .await;
    for (path, reply) in paths.iter().zip(replies) {
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{path}");
        assert!(!reply.body.contains("hunter2"), "{path}: {}", reply.body);
    }
}

#[test]
fn direction_overrides_are_shown_as_escapes() {
    use super::html::Shown;
    let shown = maud::html! { (Shown("order-\u{202e}1-redro\u{2066}")) }.into_string();
    assert_eq!(shown, "order-\\u{202e}1-redro\\u{2066}");
    // Then escaped for HTML, in text and in attribute values alike.
    let shown = maud::html! {
        p title=(Shown("\"><script>x</script>\u{1b}")) { (Shown("<b>&\u{7}\n\t")) }
    }
    .into_string();
    assert_eq!(
        shown,
        "<p title=\"&quot;&gt;&lt;script&gt;x&lt;/script&gt;\\u{1b}\">&lt;b&gt;&amp;\\u{7}\n\t</p>"
    );
}

#[tokio::test]
async fn posts_need_the_csrf_token_and_the_operator_role() {
    let router = offline();
    let (operator, csrf) = login(&router, "ada", OPERATOR_PASSWORD).await;
    let form = |csrf: &'static str| -> Vec<(&'static str, &'static str)> {
        vec![
            ("csrf", csrf),
            ("note", "test"),
            ("confirm", "yes"),
            ("event", "not-a-uuid"),
        ]
    };
    let missing = send(
        &router,
        post("/actions/requeue", Some(&operator), &form("")[1..]),
    )
    .await;
    assert_eq!(missing.status, StatusCode::FORBIDDEN, "{}", missing.body);
    assert!(missing.body.contains("CSRF"), "{}", missing.body);
    let wrong = send(
        &router,
        post("/api/actions/requeue", Some(&operator), &form("abc")),
    )
    .await;
    assert_eq!(wrong.status, StatusCode::FORBIDDEN);
    assert!(wrong.body.contains("CSRF"), "{}", wrong.body);
    let logout = send(&router, post("/logout", Some(&operator), &[])).await;
    assert_eq!(
        logout.status,
        StatusCode::FORBIDDEN,
        "logout needs the token too"
    );

    // With the token: no confirmation, no note, bad input: 400, and nothing read (the
    // database is down: a read would be a 503).
    let leaked: &'static str = Box::leak(csrf.clone().into_boxed_str());
    let mut unconfirmed = form(leaked);
    unconfirmed.retain(|(k, _)| *k != "confirm");
    let reply = send(
        &router,
        post("/actions/requeue", Some(&operator), &unconfirmed),
    )
    .await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert!(reply.body.contains("I confirm"), "{}", reply.body);
    let mut no_note = form(leaked);
    no_note.retain(|(k, _)| *k != "note");
    let reply = send(&router, post("/actions/requeue", Some(&operator), &no_note)).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    let reply = send(
        &router,
        post("/api/actions/requeue", Some(&operator), &form(leaked)),
    )
    .await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert!(reply.body.contains("not an event id"), "{}", reply.body);
    let reply = send(
        &router,
        post("/actions/frobnicate", Some(&operator), &form(leaked)),
    )
    .await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND);

    // A viewer's action is refused, token or not; their pages show the buttons disabled.
    let (viewer, viewer_csrf) = login(&router, "vic", VIEWER_TOKEN).await;
    let leaked: &'static str = Box::leak(viewer_csrf.into_boxed_str());
    let reply = send(
        &router,
        post("/actions/requeue", Some(&viewer), &form(leaked)),
    )
    .await;
    assert_eq!(reply.status, StatusCode::FORBIDDEN);
    assert!(reply.body.contains("viewer"), "{}", reply.body);
    // Another session's token is not this one's.
    let reply = send(
        &router,
        post("/actions/requeue", Some(&operator), &form(leaked)),
    )
    .await;
    assert_eq!(reply.status, StatusCode::FORBIDDEN);
    assert!(reply.body.contains("CSRF"), "{}", reply.body);

    // Logging out ends the session.
    let reply = send(&router, post("/logout", Some(&viewer), &[("csrf", leaked)])).await;
    assert_eq!(reply.status, StatusCode::SEE_OTHER);
    let reply = send(&router, get("/", Some(&viewer))).await;
    assert_eq!(reply.status, StatusCode::SEE_OTHER);
}

#[tokio::test]
async fn a_database_that_does_not_answer_is_a_503_that_says_so() {
    let router = offline();
    let (cookie, _) = login(&router, "vic", VIEWER_TOKEN).await;
    let reply = send(&router, get("/api/timeline?id=order-1", Some(&cookie))).await;
    assert_eq!(
        reply.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        reply.body
    );
    assert!(reply.body.contains("did not answer"), "{}", reply.body);
    // What the client is told is that, with a reference to the log's line: not the driver's
    // text, nor the database's host, user or name.
    for shown in ["127.0.0.1", "nobody", "none", "refused", "onnect"] {
        assert!(!reply.body.contains(shown), "{shown}: {}", reply.body);
    }
    assert!(reply.body.contains("reference "), "{}", reply.body);
    let page = send(&router, get("/outbox", Some(&cookie))).await;
    assert_eq!(
        page.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "the page says so, in its panel, and its status too"
    );
    assert!(page.body.contains("did not answer"), "{}", page.body);
    // Within a moment of a failed connection, the next request is refused at once instead of
    // trying again.
    let started = std::time::Instant::now();
    let groups = send(&router, get("/groups", Some(&cookie))).await;
    assert_eq!(groups.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // The overview answers from its last reading (none yet) at once.
    let overview = send(&router, get("/api/overview", Some(&cookie))).await;
    assert_eq!(overview.status, StatusCode::OK);
    let bad = send(
        &router,
        get("/api/dead-letters?since=yesterday", Some(&cookie)),
    )
    .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{}", bad.body);
    assert!(bad.body.contains("RFC 3339"), "{}", bad.body);
}

#[tokio::test]
async fn a_viewer_reads_and_an_operator_acts_on_a_real_database() {
    let (name, pool) = migrated_database("operator_console")
        .await
        .expect("database");
    let url = database_url(&pool);
    let router = console(&url).router();
    let (viewer, _) = login(&router, "vic", VIEWER_TOKEN).await;
    let page = send(&router, get("/outbox", Some(&viewer))).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    assert!(page.body.contains("Failed events"), "{}", page.body);
    assert!(
        page.body.contains(r#"class="act" disabled"#),
        "a viewer's buttons are disabled"
    );
    let api = send(&router, get("/api/outbox", Some(&viewer))).await;
    assert_eq!(api.status, StatusCode::OK, "{}", api.body);
    let data: serde_json::Value = serde_json::from_str(&api.body).expect("json");
    assert_eq!(data["failed"], serde_json::json!([]));
    let unknown = send(
        &router,
        get("/api/timeline?id=no-such-order", Some(&viewer)),
    )
    .await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND, "{}", unknown.body);
    // An id PostgreSQL could not even compare (a NUL character) is the request's fault.
    let nul = send(&router, get("/api/timeline?id=a%00b", Some(&viewer))).await;
    assert_eq!(nul.status, StatusCode::BAD_REQUEST, "{}", nul.body);
    assert!(nul.body.contains("NUL"), "{}", nul.body);
    let group = send(
        &router,
        get("/api/dead-letters?group=nosuch", Some(&viewer)),
    )
    .await;
    assert_eq!(group.status, StatusCode::BAD_REQUEST, "{}", group.body);

    let (operator, csrf) = login(&router, "ada", OPERATOR_PASSWORD).await;
    let page = send(&router, get("/outbox", Some(&operator))).await;
    assert!(
        !page.body.contains(r#"class="act" disabled"#),
        "an operator's are not"
    );
    let event = uuid::Uuid::new_v4().to_string();
    let reply = send(
        &router,
        post(
            "/api/actions/requeue",
            Some(&operator),
            &[
                ("csrf", &csrf),
                ("note", "r"),
                ("confirm", "yes"),
                ("event", &event),
            ],
        ),
    )
    .await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND, "{}", reply.body);
    assert!(reply.body.contains(&event), "{}", reply.body);
    drop(pool);
    drop_database(&server_url(), &name).await.expect("drop");
}

#[tokio::test]
async fn delayed_events_are_published_now_or_cancelled_and_recorded() {
    let (name, pool) = migrated_database("operator_console_delayed")
        .await
        .expect("database");
    let router = console(&database_url(&pool)).router();
    let (early, withdrawn) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    for (id, key) in [(early, "reminder-1"), (withdrawn, "reminder-2")] {
        let _ = sqlx::query(
            "INSERT INTO outbox_delayed (event_id, business_key, event_type, aggregate_id, topic,
                                         payload, publish_at)
             VALUES ($1, $2, 'order.payment_reminder', 'order-7', 'orders', '{}',
                     now() + interval '1 day')",
        )
        .bind(id)
        .bind(key)
        .execute(&pool)
        .await
        .expect("delayed event");
    }
    let (cookie, csrf) = login(&router, "ada", OPERATOR_PASSWORD).await;
    let page = send(&router, get("/outbox", Some(&cookie))).await;
    assert!(page.body.contains(&early.to_string()), "{}", page.body);
    let act = |how: &'static str, event: String| {
        let (cookie, csrf) = (cookie.clone(), csrf.clone());
        let router = router.clone();
        async move {
            send(
                &router,
                post(
                    "/api/actions/delayed",
                    Some(&cookie),
                    &[
                        ("csrf", &csrf),
                        ("note", "customer asked"),
                        ("confirm", "yes"),
                        ("how", how),
                        ("event", &event),
                    ],
                ),
            )
            .await
        }
    };
    let reply = act("publish_now", early.to_string()).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    let due: bool = sqlx::query_scalar(
        "SELECT publish_at <= clock_timestamp() FROM outbox_delayed WHERE event_id = $1",
    )
    .bind(early)
    .fetch_one(&pool)
    .await
    .expect("due");
    assert!(due, "published now: due at once");
    let reply = act("cancel", withdrawn.to_string()).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_delayed WHERE event_id = $1")
        .bind(withdrawn)
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(left, 0, "cancelled");
    // Again: nothing waits any more, and that is bad input, not an error.
    let reply = act("cancel", withdrawn.to_string()).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.body);
    let actions: Vec<(String, String, String)> =
        sqlx::query_as("SELECT actor, action, reason FROM operator_action ORDER BY id")
            .fetch_all(&pool)
            .await
            .expect("actions");
    assert_eq!(
        actions,
        vec![
            (
                "ada".into(),
                "outbox.delayed.publish_now".into(),
                "customer asked".into()
            ),
            (
                "ada".into(),
                "outbox.delayed.cancel".into(),
                "customer asked".into()
            ),
        ]
    );
    let trace = send(&router, get("/api/timeline?id=order-7", Some(&cookie))).await;
    assert_eq!(trace.status, StatusCode::OK, "{}", trace.body);
    assert!(
        trace.body.contains("outbox.delayed.cancel"),
        "{}",
        trace.body
    );
    assert!(
        trace.body.contains("by ada: customer asked"),
        "{}",
        trace.body
    );
    drop(pool);
    drop_database(&server_url(), &name).await.expect("drop");
}

#[tokio::test]
async fn a_name_no_user_has_is_throttled_as_a_users_name_is() {
    let router = offline();
    // Ten guesses, from ten addresses, of a name nobody has and of one a user has: the same
    // answers, then the same 429, so throttling does not tell which names exist.
    for name in ["mallory", "ada"] {
        let guesses = futures::future::join_all((0..11).map(|i| {
            let router = router.clone();
            async move {
                send(
                    &router,
                    login_from(&format!("198.18.{}.{i}:4000", name.len()), name, "guess"),
                )
                .await
                .status
            }
        }))
        .await;
        let refused = guesses
            .iter()
            .filter(|s| **s == StatusCode::UNAUTHORIZED)
            .count();
        let throttled = guesses
            .iter()
            .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
            .count();
        assert_eq!((refused, throttled), (10, 1), "{name}");
    }
    // A name no user could have (a control character, a space, 65 characters) is refused as a
    // wrong password is.
    for name in ["x\n\u{1b}[31mFORGED", "a b", &"n".repeat(65)] {
        let reply = send(&router, login_from("198.18.9.9:4000", name, "guess")).await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{name:?}");
        assert!(reply.body.contains("Wrong user name or password"));
    }
}

/// Inserts `count` open dead letters of `group`, one order each.
async fn letters(pool: &sqlx::PgPool, group: &str, count: i64) -> Vec<i64> {
    sqlx::query_scalar(
        "INSERT INTO dead_letter (group_name, aggregate_id, sequence, event_type, topic, partition,
                                  kafka_offset, reason)
         SELECT $1, 'order-' || $1 || '-' || lpad(n::text, 4, '0'), 1, 'order.placed', 'orders',
                0, n, 'test'
         FROM generate_series(1, $2) n
         RETURNING id",
    )
    .bind(group)
    .bind(count)
    .fetch_all(pool)
    .await
    .expect("letters")
}

#[tokio::test]
async fn letters_are_paged_in_sql_across_groups_and_only_the_groups_given_are_in_reach() {
    let (name, pool) = migrated_database("operator_console_paging")
        .await
        .expect("database");
    let url = database_url(&pool);
    let _ = letters(&pool, "ga", 60).await;
    let _ = letters(&pool, "gb", 30).await;
    let router = console_with(&url, &["--group", "ga", "--group", "gb"]).router();
    let (cookie, _) = login(&router, "ada", OPERATOR_PASSWORD).await;
    let page = |n: usize| {
        let (router, cookie) = (router.clone(), cookie.clone());
        async move {
            let reply = send(
                &router,
                get(&format!("/api/dead-letters?page={n}"), Some(&cookie)),
            )
            .await;
            assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
            let data: serde_json::Value = serde_json::from_str(&reply.body).expect("json");
            let groups: Vec<String> = data["letters"]
                .as_array()
                .expect("letters")
                .iter()
                .map(|l| l["group"].as_str().expect("group").to_owned())
                .collect();
            (data["total"].as_u64().expect("total"), groups)
        }
    };
    let (total, first) = page(1).await;
    assert_eq!((total, first.len()), (90, 50));
    assert!(first.iter().all(|g| g == "ga"));
    let (_, second) = page(2).await;
    assert_eq!(second.iter().filter(|g| *g == "ga").count(), 10);
    assert_eq!(second.iter().filter(|g| *g == "gb").count(), 30);
    assert!(page(3).await.1.is_empty());
    assert!(page(usize::MAX).await.1.is_empty());

    // A console given one group reads and acts on that group alone.
    let scoped = console_with(&url, &["--group", "ga"]).router();
    let (cookie, csrf) = login(&scoped, "ada", OPERATOR_PASSWORD).await;
    let outside = send(&scoped, get("/api/dead-letters?group=gb", Some(&cookie))).await;
    assert_eq!(outside.status, StatusCode::FORBIDDEN, "{}", outside.body);
    let all = send(&scoped, get("/api/dead-letters", Some(&cookie))).await;
    let data: serde_json::Value = serde_json::from_str(&all.body).expect("json");
    assert_eq!(data["total"], 60, "{}", all.body);
    for action in ["pause", "dead-letters"] {
        let reply = send(
            &scoped,
            post(
                &format!("/api/actions/{action}"),
                Some(&cookie),
                &[
                    ("csrf", &csrf),
                    ("note", "outside"),
                    ("confirm", "yes"),
                    ("group", "gb"),
                    ("how", "discard"),
                    ("scope", "matching"),
                    ("filter_group", "gb"),
                ],
            ),
        )
        .await;
        assert_eq!(
            reply.status,
            StatusCode::FORBIDDEN,
            "{action}: {}",
            reply.body
        );
    }
    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM dead_letter WHERE group_name = 'gb' AND status = 'open'",
    )
    .fetch_one(&pool)
    .await
    .expect("count");
    assert_eq!(open, 30);
    drop(pool);
    drop_database(&server_url(), &name).await.expect("drop");
}

#[test]
fn the_http_limits_default_as_the_library_does_and_are_settings() {
    #[derive(clap::Parser)]
    struct ConsoleOnly {
        #[command(flatten)]
        console: super::ConsoleArgs,
    }
    let parsed = ConsoleOnly::try_parse_from(["console"]).expect("arguments");
    assert_eq!(
        parsed.console.limits,
        pipeline_core::http_server::ServerLimits::default()
    );
    let parsed = ConsoleOnly::try_parse_from([
        "console",
        "--http-max-connections",
        "100",
        "--http-header-read-timeout",
        "3s",
    ])
    .expect("arguments");
    assert_eq!(parsed.console.limits.max_connections, 100);
    assert_eq!(
        parsed.console.limits.header_read_timeout,
        Duration::from_secs(3)
    );
}

#[test]
fn a_group_name_or_prefix_with_a_control_character_is_refused() {
    for args in [
        vec!["pipeline", "--group", "inventory\u{1b}[2J"],
        vec!["pipeline", "--group", "inventory,noti\nfication"],
        vec!["pipeline", "--group-prefix", "t-\r"],
        vec!["pipeline", "--group-database", "in\u{7}v=postgres://db/x"],
    ] {
        let refused = TargetsOnly::try_parse_from(&args).err();
        assert!(refused.is_some(), "{args:?} accepted");
    }
    let fine = TargetsOnly::try_parse_from(["pipeline", "--group", "inventory,notification"])
        .expect("arguments");
    assert_eq!(fine.targets.groups, ["inventory", "notification"]);
}

#[test]
fn argon2_hashes_of_any_parameters_verify_in_one_reused_memory() {
    use argon2::password_hash::{PasswordHasher, SaltString};
    let salt = SaltString::encode_b64(b"a salt of 16 b!!").expect("salt");
    let small = argon2::Argon2::new(
        argon2::Algorithm::Argon2i,
        argon2::Version::V0x10,
        argon2::Params::new(64, 2, 1, Some(24)).expect("params"),
    )
    .hash_password(b"small secret", &salt)
    .expect("hash")
    .to_string();
    let default = hash_password(OPERATOR_PASSWORD).expect("hash");
    let users =
        Users::parse(&format!("sam:viewer:{small}\nada:operator:{default}\n")).expect("users");
    let mut memory = Vec::new();
    for _ in 0..2 {
        assert_eq!(
            users.verify_in("sam", "small secret", &mut memory),
            Some(Role::Viewer)
        );
        assert_eq!(users.verify_in("sam", "small secreT", &mut memory), None);
        assert_eq!(
            users.verify_in("ada", OPERATOR_PASSWORD, &mut memory),
            Some(Role::Operator)
        );
        assert_eq!(users.verify_in("ada", "wrong", &mut memory), None);
    }
}

#[test]
fn a_duration_flag_below_its_floor_or_without_a_unit_is_refused() {
    let refresh = super::at_least(Duration::from_secs(1));
    assert_eq!(refresh("2s"), Ok(Duration::from_secs(2)));
    assert_eq!(refresh("1m"), Ok(Duration::from_secs(60)));
    let short = refresh("500ms").expect_err("below the floor");
    assert!(short.contains("at least 1s"), "{short}");
    assert!(refresh("3").is_err(), "a bare number has no unit");
    assert!(refresh("-1s").is_err());
}

#[test]
fn a_prefix_is_empty_or_a_plain_absolute_path() {
    #[derive(clap::Parser)]
    struct ConsoleOnly {
        #[command(flatten)]
        console: super::ConsoleArgs,
    }
    let parsed = ConsoleOnly::try_parse_from(["console"]).expect("arguments");
    assert_eq!(parsed.console.prefix, "", "served at the root by default");
    for fine in ["", "/ops", "/ops/console", "/a.b_c~d-e/F9"] {
        let parsed = ConsoleOnly::try_parse_from(["console", "--prefix", fine]).expect(fine);
        assert_eq!(parsed.console.prefix, fine);
    }
    for (bad, why) in [
        ("/", "end with"),
        ("ops", "start with"),
        ("/ops/", "end with"),
        ("/ops//console", "segment"),
        ("/ops/../admin", "segment"),
        ("/ops/./console", "segment"),
        ("/..", "segment"),
        ("/ops console", "only"),
        ("/ops?x=1", "only"),
        ("/ops#x", "only"),
        ("/ops%2F", "only"),
        ("/\u{e9}t\u{e9}", "only"),
        ("/ops\\x", "only"),
        ("/ops\"x", "only"),
    ] {
        let refused = ConsoleOnly::try_parse_from(["console", "--prefix", bad])
            .err()
            .unwrap_or_else(|| panic!("{bad:?} accepted by the command line"));
        assert!(refused.to_string().contains(why), "{bad:?}: {refused}");
        let settings = ConsoleSettings {
            prefix: bad.to_owned(),
            ..ConsoleSettings::default()
        };
        let args = TargetsOnly::try_parse_from(["pipeline"]).expect("arguments");
        let refused = Console::new(
            Targets::new(args.targets, &Groups::new()),
            Groups::new(),
            users(),
            settings,
        )
        .err()
        .unwrap_or_else(|| panic!("{bad:?} accepted by Console::new"));
        let super::ConsoleError::Prefix { prefix, reason } = &refused;
        assert_eq!(prefix, bad);
        assert!(reason.contains(why), "{bad:?}: {refused}");
    }
}

/// Every URL a page hands the browser: its `href`, `src` and `action` attributes, and the
/// overview's `data-api` and `data-login`, for the script.
fn urls_in(html: &str) -> Vec<String> {
    let mut found = Vec::new();
    for attribute in [
        " href=\"",
        " src=\"",
        " action=\"",
        " data-api=\"",
        " data-login=\"",
    ] {
        for (at, _) in html.match_indices(attribute) {
            let rest = &html[at + attribute.len()..];
            let end = rest.find('"').expect("a closed attribute");
            found.push(rest[..end].replace("&amp;", "&"));
        }
    }
    found
}

/// Asserts every URL of `html` is under `prefix` (a path of this console at the root); returns
/// how many there are.
fn assert_inside(prefix: &str, what: &str, html: &str) -> usize {
    let urls = urls_in(html);
    for url in &urls {
        let inside = match prefix {
            "" => url.starts_with('/') && !url.starts_with("//"),
            _ => {
                url == prefix
                    || url.starts_with(&format!("{prefix}/"))
                    || url.starts_with(&format!("{prefix}?"))
            }
        };
        assert!(inside, "{what}: {url} is outside {prefix:?}\n{html}");
    }
    urls.len()
}

fn location(reply: &Reply) -> &str {
    reply.headers[header::LOCATION].to_str().expect("location")
}

#[tokio::test]
async fn under_a_prefix_the_login_its_redirects_and_the_cookie_stay_inside_it() {
    for prefix in ["", "/ops/console"] {
        let console = console_at(
            "postgres://nobody@127.0.0.1:9/none?sslmode=disable&connect_timeout=1",
            &[],
            prefix,
        );
        // Served as `pipeline console --prefix` serves it: nested at the prefix, as a host does.
        let router = console.app();
        let overview = if prefix.is_empty() { "/" } else { prefix };

        // Without a session: to the login form, back to the page asked for.
        let reply = send(&router, get(overview, None)).await;
        assert_eq!(reply.status, StatusCode::SEE_OTHER, "{prefix}");
        assert_eq!(location(&reply), format!("{prefix}/login?next={overview}"));
        assert_security_headers(&reply);
        let reply = send(
            &router,
            get(&format!("{prefix}/dead-letters?group=a"), None),
        )
        .await;
        assert_eq!(
            location(&reply),
            format!("{prefix}/login?next={prefix}/dead-letters%3Fgroup%3Da")
        );
        let reply = send(&router, get(&format!("{prefix}/api/overview"), None)).await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
        assert!(
            reply.body.contains(&format!("POST {prefix}/login")),
            "{}",
            reply.body
        );

        // The login form: every link, the stylesheet, the script and the form under the prefix.
        let next = format!("{prefix}/outbox");
        let page = send(&router, get(&format!("{prefix}/login?next={next}"), None)).await;
        assert_eq!(page.status, StatusCode::OK, "{}", page.body);
        assert!(
            assert_inside(prefix, "login", &page.body) >= 3,
            "{}",
            page.body
        );
        for expected in [
            format!(r#"href="{prefix}/static/console.css""#),
            format!(r#"src="{prefix}/static/console.js""#),
            format!(r#"action="{prefix}/login""#),
            format!(r#"name="next" value="{next}""#),
        ] {
            assert!(page.body.contains(&expected), "{expected}: {}", page.body);
        }
        // The static files are served under it, cacheable as at the root (the security layer
        // sees the path under the prefix); pages are not cached.
        let css = send(&router, get(&format!("{prefix}/static/console.css"), None)).await;
        assert_eq!(css.status, StatusCode::OK);
        assert_eq!(css.headers[header::CACHE_CONTROL], "no-cache");
        assert_eq!(page.headers[header::CACHE_CONTROL], "no-store");

        // After logging in, only a path under the prefix is followed.
        let mut open_redirects = vec!["//evil.example", "https://evil", "/\\evil.example"];
        if !prefix.is_empty() {
            open_redirects.extend(["/other-app", "/ops/consolex", "/ops/console/../other-app"]);
        }
        for next in open_redirects {
            let reply = send(
                &router,
                post(
                    &format!("{prefix}/login"),
                    None,
                    &[("user", "vic"), ("password", VIEWER_TOKEN), ("next", next)],
                ),
            )
            .await;
            assert_eq!(
                reply.status,
                StatusCode::SEE_OTHER,
                "{next}: {}",
                reply.body
            );
            assert_eq!(location(&reply), overview, "{next}");
        }
        let (cookie, csrf) = login_at(&router, prefix, "vic", VIEWER_TOKEN).await;

        // The overview's frame: its script's fetch and its way back to the login under the prefix.
        let page = send(&router, get(overview, Some(&cookie))).await;
        assert_eq!(page.status, StatusCode::OK, "{}", page.body);
        assert!(
            assert_inside(prefix, "overview", &page.body) >= 10,
            "{}",
            page.body
        );
        for expected in [
            format!(r#"data-api="{prefix}/api/overview""#),
            format!(r#"data-login="{prefix}/login?next={overview}""#),
            format!(r#"action="{prefix}/logout""#),
            format!(r#"href="{prefix}/dead-letters""#),
        ] {
            assert!(page.body.contains(&expected), "{expected}: {}", page.body);
        }
        let api = send(
            &router,
            get(&format!("{prefix}/api/overview"), Some(&cookie)),
        )
        .await;
        assert_eq!(api.status, StatusCode::OK, "{}", api.body);
        // A path the console does not have: its refusal page links under the prefix too.
        let missing = send(&router, get(&format!("{prefix}/nope"), Some(&cookie))).await;
        assert_eq!(missing.status, StatusCode::NOT_FOUND);
        assert!(missing.body.contains("no such page"), "{}", missing.body);
        assert!(assert_inside(prefix, "404", &missing.body) >= 3);
        assert_security_headers(&missing);

        // Logging out: back to the login form, the cookie cleared on the same path.
        let reply = send(
            &router,
            post(
                &format!("{prefix}/logout"),
                Some(&cookie),
                &[("csrf", &csrf)],
            ),
        )
        .await;
        assert_eq!(reply.status, StatusCode::SEE_OTHER);
        assert_eq!(location(&reply), format!("{prefix}/login"));
        let cleared = reply.headers[header::SET_COOKIE].to_str().expect("cookie");
        assert!(
            cleared.contains(&format!("Path={overview};")) && cleared.contains("Max-Age=0"),
            "{cleared}"
        );
    }

    // Outside the prefix: the root and the prefix with a slash lead to the overview, anything
    // else is a 404 page that links back into the console.
    let router = offline_at("/ops/console");
    for path in ["/", "/ops/console/"] {
        let reply = send(&router, get(path, None)).await;
        assert_eq!(reply.status, StatusCode::SEE_OTHER, "{path}");
        assert_eq!(location(&reply), "/ops/console", "{path}");
    }
    for path in ["/login", "/ops/consolex", "/ops", "/static/console.js"] {
        let reply = send(&router, get(path, None)).await;
        assert_eq!(reply.status, StatusCode::NOT_FOUND, "{path}");
        assert_security_headers(&reply);
        assert!(assert_inside("/ops/console", path, &reply.body) >= 3);
    }
}

/// `html` without its hidden fields and check boxes: what a page displays.
fn without_values_sent_back(html: &str) -> String {
    let mut out = String::new();
    let mut rest = html;
    while let Some(at) = rest.find("<input ") {
        out.push_str(&rest[..at]);
        let end = at + rest[at..].find('>').expect("a closed tag") + 1;
        let tag = &rest[at..end];
        if !tag.contains(r#"type="hidden""#) && !tag.contains(r#"type="checkbox""#) {
            out.push_str(tag);
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// `offline()` under `prefix`, as `pipeline console --prefix` serves it.
fn offline_at(prefix: &str) -> Router {
    console_at(
        "postgres://nobody@127.0.0.1:9/none?sslmode=disable&connect_timeout=1",
        &[],
        prefix,
    )
    .app()
}

#[tokio::test]
async fn every_page_links_inside_the_prefix_and_shows_hostile_data_escaped() {
    let (name, pool) = migrated_database("operator_console_prefix")
        .await
        .expect("database");
    let url = database_url(&pool);
    // Enough letters for a second page (its links), a delayed event (the outbox's order links)
    // and a letter whose order and reason are hostile.
    let _ = letters(&pool, "ga", 60).await;
    let hostile_order = "<img src=x onerror=alert(1)>\u{202e}1-redro";
    let _ = sqlx::query(
        "INSERT INTO dead_letter (group_name, aggregate_id, sequence, event_type, topic, partition,
                                  kafka_offset, reason)
         VALUES ('ga', $1, 1, 'order.placed', 'orders', 0, 999, $2)",
    )
    .bind(hostile_order)
    .bind("\"><script>alert(2)</script>\u{2066}")
    .execute(&pool)
    .await
    .expect("hostile letter");
    let delayed = uuid::Uuid::new_v4();
    let _ = sqlx::query(
        "INSERT INTO outbox_delayed (event_id, business_key, event_type, aggregate_id, topic,
                                     payload, publish_at)
         VALUES ($1, 'reminder-1', 'order.payment_reminder', 'order-7', 'orders', '{}',
                 now() + interval '1 day')",
    )
    .bind(delayed)
    .execute(&pool)
    .await
    .expect("delayed event");

    for prefix in ["", "/ops/console"] {
        let router = console_at(&url, &["--group", "ga"], prefix).app();
        let (cookie, csrf) = login_at(&router, prefix, "ada", OPERATOR_PASSWORD).await;
        let hostile = super::urls::url_encode(hostile_order);
        let pages = [
            ("/".to_owned(), StatusCode::OK),
            ("/timeline".to_owned(), StatusCode::OK),
            ("/timeline?id=order-7".to_owned(), StatusCode::OK),
            // No step of that order: a refusal, its message naming the id as shown.
            (format!("/timeline?id={hostile}"), StatusCode::NOT_FOUND),
            ("/dead-letters".to_owned(), StatusCode::OK),
            ("/dead-letters?group=ga&page=2".to_owned(), StatusCode::OK),
            (format!("/dead-letters?order={hostile}"), StatusCode::OK),
            ("/outbox".to_owned(), StatusCode::OK),
            ("/groups".to_owned(), StatusCode::OK),
            (
                "/dead-letters?since=yesterday".to_owned(),
                StatusCode::BAD_REQUEST,
            ),
        ];
        for (page, status) in pages {
            let path = if page == "/" && !prefix.is_empty() {
                prefix.to_owned()
            } else {
                format!("{prefix}{page}")
            };
            let reply = send(&router, get(&path, Some(&cookie))).await;
            assert_eq!(reply.status, status, "{path}: {}", reply.body);
            // The stylesheet, the script, five links of the navigation and the logout form at
            // least (none on a refusal's page, which has its way back to the overview).
            let least = if status == StatusCode::OK { 8 } else { 3 };
            assert!(assert_inside(prefix, &path, &reply.body) >= least, "{path}");
            // Hostile text is escaped, never markup; shown, its direction override is an escape
            // (only a value the form sends back, never displayed, keeps it as stored).
            for raw in ["<img src=x", "<script>alert"] {
                assert!(
                    !reply.body.contains(raw),
                    "{path}: {raw:?} in\n{}",
                    reply.body
                );
            }
            let shown = without_values_sent_back(&reply.body);
            for raw in ["\u{202e}", "\u{2066}"] {
                assert!(!shown.contains(raw), "{path}: {raw:?} in\n{shown}");
            }
        }
        let letters = send(
            &router,
            get(
                &format!("{prefix}/dead-letters?order={hostile}"),
                Some(&cookie),
            ),
        )
        .await;
        for shown in [
            "&lt;img src=x onerror=alert(1)&gt;\\u{202e}1-redro",
            "&quot;&gt;&lt;script&gt;alert(2)&lt;/script&gt;\\u{2066}",
        ] {
            assert!(letters.body.contains(shown), "{shown}: {}", letters.body);
        }
        let first = send(
            &router,
            get(&format!("{prefix}/dead-letters"), Some(&cookie)),
        )
        .await;
        let next = format!(r#"href="{prefix}/dead-letters?page=2""#);
        assert!(first.body.contains(&next), "{next}: {}", first.body);
        let second = send(
            &router,
            get(
                &format!("{prefix}/dead-letters?group=ga&page=2"),
                Some(&cookie),
            ),
        )
        .await;
        let previous = format!(r#"href="{prefix}/dead-letters?group=ga&amp;page=1""#);
        assert!(
            second.body.contains(&previous),
            "{previous}: {}",
            second.body
        );
        let outbox = send(&router, get(&format!("{prefix}/outbox"), Some(&cookie))).await;
        let order_link = format!(r#"href="{prefix}/timeline?id=order-7""#);
        assert!(outbox.body.contains(&order_link), "{}", outbox.body);

        // An action's page: its way back under the prefix.
        let done = send(
            &router,
            post(
                &format!("{prefix}/actions/delayed"),
                Some(&cookie),
                &[
                    ("csrf", &csrf),
                    ("note", "customer asked"),
                    ("confirm", "yes"),
                    ("how", "publish_now"),
                    ("event", &delayed.to_string()),
                ],
            ),
        )
        .await;
        assert_eq!(done.status, StatusCode::OK, "{}", done.body);
        assert!(assert_inside(prefix, "action", &done.body) >= 8);
        let back = format!(r#"href="{prefix}/outbox" id="back""#);
        assert!(done.body.contains(&back), "{back}: {}", done.body);
    }
    drop(pool);
    drop_database(&server_url(), &name).await.expect("drop");
}
