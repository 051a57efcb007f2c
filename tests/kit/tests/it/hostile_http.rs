//! Hostile clients against the real `pipeline console`, order service and relay processes, as an
//! attacker on the network would try it: a login flood, slow and idle connections, floods of
//! database reads and of orders, oversized bodies, and secrets wherever a database URL can carry
//! them. Each asserts that the server stays up (the console within its memory bound), keeps
//! answering a legitimate client (from another address: 127.0.0.2), loses nothing, and shows no
//! secret to a client or in its log. Also the `pipeline` command's tables, which print what
//! services and clients wrote.

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::future::join_all;
use pipeline_testkit::{Service, TestEnv};
use reqwest::{redirect, Client, StatusCode};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use uuid::Uuid;

/// The console's peak resident memory that a flood may not exceed.
const RSS_BOUND_BYTES: u64 = 300 * 1024 * 1024;

fn sha256_hex(secret: &str) -> String {
    Sha256::digest(secret.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A client from `address` (a loopback address of its own: the console throttles and caps
/// connections per client address) that does not follow redirects. It keeps an idle connection
/// for a second only, well within the servers' header-read timeouts (which close a connection
/// idle that long), as a client of these servers should.
fn client_from(address: [u8; 4]) -> anyhow::Result<Client> {
    Ok(Client::builder()
        .redirect(redirect::Policy::none())
        .pool_idle_timeout(Duration::from_secs(1))
        .local_address(IpAddr::V4(Ipv4Addr::from(address)))
        .timeout(Duration::from_secs(60))
        .build()?)
}

/// Logs in and returns the session cookie (`name=value`).
async fn login(http: &Client, base: &str, user: &str, password: &str) -> anyhow::Result<String> {
    let reply = http
        .post(format!("{base}/login"))
        .form(&[("user", user), ("password", password)])
        .send()
        .await?;
    anyhow::ensure!(
        reply.status() == StatusCode::SEE_OTHER,
        "login of {user}: {}",
        reply.status()
    );
    let cookie = reply
        .headers()
        .get("set-cookie")
        .context("no cookie")?
        .to_str()?;
    Ok(cookie.split(';').next().unwrap_or_default().to_owned())
}

/// The process's peak resident memory (`VmHWM`), in bytes.
fn peak_rss(service: &Service) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{}/status", service.pid()))?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .context("no VmHWM")?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()?;
    Ok(kib * 1024)
}

struct Console {
    service: Service,
    base: String,
    viewer_password: String,
}

async fn console(env: &TestEnv, args: &[&str], vars: &[(&str, &str)]) -> anyhow::Result<Console> {
    let viewer_password = Uuid::new_v4().simple().to_string();
    let operator_password = Uuid::new_v4().simple().to_string();
    let users_file = env.log_dir.join("console-users");
    std::fs::write(
        &users_file,
        format!(
            "ada:operator:sha256:{}\nvic:viewer:sha256:{}\n",
            sha256_hex(&operator_password),
            sha256_hex(&viewer_password)
        ),
    )?;
    let users = users_file.to_string_lossy().into_owned();
    let mut all_args = vec!["--topic", &env.topic, "--group-prefix", &env.group_prefix];
    all_args.extend_from_slice(args);
    all_args.extend_from_slice(&["console", "--listen", "127.0.0.1:0"]);
    let mut all_vars = vec![("PIPELINE_CONSOLE_USERS_FILE", users.as_str())];
    all_vars.extend_from_slice(vars);
    let service = env.spawn_with_env("pipeline", "console", &all_args, &all_vars)?;
    let addr = service
        .wait_for_log_value("pipeline console listening on ", Duration::from_secs(30))
        .await?;
    Ok(Console {
        service,
        base: format!("http://{addr}"),
        viewer_password,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_holds_under_login_floods_slow_clients_and_read_floods() -> anyhow::Result<()> {
    let env = TestEnv::new("hostile_console", 1).await?;
    // Letters to read, in the group the flood asks for.
    let group = env.group("inventory");
    let _ = sqlx::query(
        "INSERT INTO dead_letter (group_name, aggregate_id, sequence, event_type, topic, partition,
                                  kafka_offset, reason)
         SELECT $1, 'order-' || n, 1, 'order.placed', 'orders', 0, n, 'test'
         FROM generate_series(1, 2000) n",
    )
    .bind(&group)
    .execute(&env.pool)
    .await?;
    let Console {
        service,
        base,
        viewer_password,
    } = console(&env, &[], &[]).await?;
    let legit = client_from([127, 0, 0, 2])?;
    let cookie = login(&legit, &base, "vic", &viewer_password).await?;
    println!(
        "before: console peak RSS {} MB",
        peak_rss(&service)? / 1024 / 1024
    );
    let overview = |legit: Client, cookie: String, base: String| async move {
        let started = Instant::now();
        let reply = legit
            .get(format!("{base}/api/overview"))
            .header("cookie", cookie)
            .send()
            .await?;
        anyhow::Ok((reply.status(), started.elapsed()))
    };

    // 1. A login flood: 400 wrong passwords at once, for a user's name and for names nobody
    //    has, each of which costs an Argon2 check (19 MiB) unless throttled.
    let attacker = client_from([127, 0, 0, 1])?;
    let flood = join_all((0..400).map(|i| {
        let (attacker, base) = (attacker.clone(), base.clone());
        async move {
            let user = if i % 2 == 0 {
                "ada".to_owned()
            } else {
                format!("guess{i}")
            };
            attacker
                .post(format!("{base}/login"))
                .form(&[("user", user.as_str()), ("password", "wrong")])
                .send()
                .await
                .map(|r| (r.status(), r.headers().get("set-cookie").is_some()))
        }
    }));
    let (answers, during) =
        tokio::join!(flood, overview(legit.clone(), cookie.clone(), base.clone()));
    let mut by_status = std::collections::BTreeMap::new();
    for answer in answers {
        // A connection beyond the per-address cap is answered 503 and closed; reqwest may see
        // that as an error instead of the answer.
        let key = match answer {
            Ok((status, session)) => {
                assert!(!session, "a wrong password opened a session");
                status.as_u16()
            }
            Err(_) => 0,
        };
        *by_status.entry(key).or_insert(0) += 1;
    }
    println!("login flood: answers by status {by_status:?}");
    assert!(
        by_status.keys().all(|s| [0, 401, 429, 503].contains(s)),
        "{by_status:?}"
    );
    assert!(
        by_status.get(&429).copied().unwrap_or(0) > 0,
        "{by_status:?}"
    );
    let (status, took) = during?;
    assert_eq!(
        status,
        StatusCode::OK,
        "the viewer's overview during the flood"
    );
    println!("login flood: the viewer's overview answered in {took:?}");
    let rss = peak_rss(&service)?;
    println!("login flood: console peak RSS {} MB", rss / 1024 / 1024);
    assert!(rss < RSS_BOUND_BYTES, "peak RSS {rss} bytes");
    // Another client, from its own address, still logs in.
    let _ = login(
        &client_from([127, 0, 0, 4])?,
        &base,
        "vic",
        &viewer_password,
    )
    .await?;

    // 2. Slow and idle clients, from an address of their own: 30 connections that send half a
    //    request head and stop, 30 that send nothing (the per-address cap is 64). The console
    //    answers others meanwhile, and holds them until the header-read timeout (10 s) has
    //    passed, then closes them.
    let addr: std::net::SocketAddr = base.trim_start_matches("http://").parse()?;
    let mut slow = Vec::new();
    let opened = Instant::now();
    for i in 0..60 {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind("127.0.0.5:0".parse()?)?;
        let mut socket: TcpStream = socket.connect(addr).await?;
        if i % 2 == 0 {
            socket
                .write_all(b"GET /api/overview HTTP/1.1\r\nHost: console\r\nX-Slow: ")
                .await?;
        }
        slow.push(socket);
    }
    let (status, took) = overview(legit.clone(), cookie.clone(), base.clone()).await?;
    assert_eq!(status, StatusCode::OK);
    println!("slow clients: the viewer's overview answered in {took:?} beside 60 held sockets");
    let deadline = opened + Duration::from_secs(25);
    for mut socket in slow {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut buf = [0u8; 512];
        let closed = loop {
            match tokio::time::timeout(left, socket.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break true,
                // A 408 or 503 answer first, then the close.
                Ok(Ok(_)) => continue,
                Err(_) => break false,
            }
        };
        assert!(closed, "a slow or idle connection still open after 25 s");
    }
    // Held, not refused: closed by the timeout, not at once for want of room.
    let held = opened.elapsed();
    println!("slow clients: the last of them closed after {held:?}");
    assert!(held >= Duration::from_secs(9), "{held:?}");

    // 3. A read flood by a logged-in client (an insider, or a stolen session): 300 list reads
    //    at once. Each is answered, read or refused as busy; none as a database that did not
    //    answer; and another client's reads go on.
    let insider = client_from([127, 0, 0, 3])?;
    let insider_cookie = login(&insider, &base, "vic", &viewer_password).await?;
    let started = Instant::now();
    let reads = join_all((0..300).map(|i| {
        let (insider, base, cookie) = (insider.clone(), base.clone(), insider_cookie.clone());
        async move {
            let reply = insider
                .get(format!("{base}/api/dead-letters?page={}", i % 40 + 1))
                .header("cookie", cookie)
                .send()
                .await?;
            let status = reply.status();
            anyhow::Ok((status, reply.text().await?))
        }
    }));
    let legit_read = {
        let (legit, base, cookie) = (legit.clone(), base.clone(), cookie.clone());
        async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let reply = legit
                .get(format!("{base}/api/dead-letters?page=2"))
                .header("cookie", cookie)
                .send()
                .await?;
            anyhow::Ok(reply.status())
        }
    };
    let (reads, legit_read) = tokio::join!(reads, legit_read);
    let mut read_status = std::collections::BTreeMap::new();
    for read in reads {
        let key = match read {
            Ok((status, body)) => {
                assert!(!body.contains("did not answer"), "{status}: {body}");
                status.as_u16()
            }
            Err(_) => 0,
        };
        *read_status.entry(key).or_insert(0) += 1;
    }
    tally(
        "read flood",
        &read_status,
        started.elapsed(),
        &[0, 200, 503],
    );
    assert!(
        read_status.get(&200).copied().unwrap_or(0) >= 64,
        "{read_status:?}"
    );
    assert_eq!(
        legit_read?,
        StatusCode::OK,
        "another client's read during the flood"
    );
    let rss = peak_rss(&service)?;
    println!(
        "after every flood: console peak RSS {} MB",
        rss / 1024 / 1024
    );
    assert!(rss < RSS_BOUND_BYTES, "peak RSS {rss} bytes");
    Ok(())
}

/// Prints a flood's answers by status (0: the connection refused before an answer was read),
/// taken in `took`, and checks that each is one of `allowed`.
fn tally(
    what: &str,
    by_status: &std::collections::BTreeMap<u16, usize>,
    took: Duration,
    allowed: &[u16],
) {
    println!("{what}: answers by status {by_status:?} in {took:?}");
    assert!(
        by_status.keys().all(|s| allowed.contains(s)),
        "{what}: {by_status:?}"
    );
}

/// Opens `count` connections to `addr` from `from`, each sending `head` (nothing when empty).
async fn hold_sockets(
    addr: std::net::SocketAddr,
    from: &str,
    count: usize,
    head: &[u8],
) -> anyhow::Result<Vec<TcpStream>> {
    let mut held = Vec::new();
    for _ in 0..count {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind(format!("{from}:0").parse()?)?;
        let mut socket = socket.connect(addr).await?;
        if !head.is_empty() {
            socket.write_all(head).await?;
        }
        held.push(socket);
    }
    Ok(held)
}

/// Waits until the server has closed every socket (after its answer, if any); returns how long
/// the last one took from `opened`, or fails when one is still open at `opened + within`.
async fn all_closed(
    sockets: Vec<TcpStream>,
    opened: Instant,
    within: Duration,
) -> anyhow::Result<Duration> {
    for mut socket in sockets {
        let left = (opened + within).saturating_duration_since(Instant::now());
        let mut buf = [0u8; 512];
        loop {
            match tokio::time::timeout(left, socket.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break,
                Ok(Ok(_)) => continue,
                Err(_) => anyhow::bail!("a slow or idle connection still open after {within:?}"),
            }
        }
    }
    Ok(opened.elapsed())
}

/// The body of an order for `customer`: one line of the first product.
fn order_body(customer: &str) -> serde_json::Value {
    serde_json::json!({
        "customer_id": customer,
        "lines": [{"product_id": "sku-00001", "quantity": 1}],
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_order_service_and_the_ops_endpoints_hold_under_floods_and_slow_clients(
) -> anyhow::Result<()> {
    let env = TestEnv::new("hostile_orders", 1).await?;
    env.seed_catalog(3)?;
    // Limits smaller than the defaults, through the service's own flags, so the test is quick.
    let (_service, base) = env
        .order_service_with_args(&[
            "--http-header-read-timeout",
            "3s",
            "--http-max-connections-per-client",
            "48",
            "--http-max-requests-in-flight",
            "32",
        ])
        .await?;
    let addr: std::net::SocketAddr = base.trim_start_matches("http://").parse()?;
    let legit = client_from([127, 0, 0, 2])?;
    let place = |http: Client, key: String| {
        let base = base.clone();
        async move {
            http.post(format!("{base}/orders"))
                .header("idempotency-key", key.as_str())
                .json(&order_body(&key))
                .send()
                .await
        }
    };

    // 1. Slow and idle clients from one address: 24 half request heads, 24 silent sockets. The
    //    49th connection from that address is told 503 at once; a client elsewhere places an
    //    order meanwhile; the held sockets are closed after the header-read timeout.
    let opened = Instant::now();
    let mut slow = hold_sockets(
        addr,
        "127.0.0.5",
        24,
        b"POST /orders HTTP/1.1\r\nHost: x\r\n",
    )
    .await?;
    slow.extend(hold_sockets(addr, "127.0.0.5", 24, b"").await?);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut beyond = hold_sockets(addr, "127.0.0.5", 1, b"").await?.remove(0);
    let mut refusal = String::new();
    tokio::time::timeout(Duration::from_secs(3), beyond.read_to_string(&mut refusal)).await??;
    assert!(refusal.starts_with("HTTP/1.1 503"), "{refusal}");
    let reply = place(legit.clone(), "legit-during-slow".to_owned()).await?;
    assert_eq!(
        reply.status(),
        StatusCode::CREATED,
        "an order beside 48 held sockets"
    );
    let held = all_closed(slow, opened, Duration::from_secs(15)).await?;
    println!("order service: 48 slow or idle sockets closed after {held:?}");
    assert!(
        held >= Duration::from_millis(2_500),
        "closed before the timeout: {held:?}"
    );

    // 2. A flood of orders, 1,200 at once from one address: each is placed (201), shed (503) or
    //    its connection refused; a client elsewhere is served meanwhile; and what the service
    //    said it placed is stored with its event, nothing more.
    let attacker = client_from([127, 0, 0, 1])?;
    let started = Instant::now();
    let flood = join_all((0..1_200).map(|i| {
        let attacker = attacker.clone();
        let place = &place;
        async move {
            let key = format!("flood-{i}");
            (key.clone(), place(attacker, key).await.map(|r| r.status()))
        }
    }));
    let legit_during = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        place(legit.clone(), "legit-during-flood".to_owned()).await
    };
    let (answers, legit_during) = tokio::join!(flood, legit_during);
    let mut by_status = std::collections::BTreeMap::new();
    let mut placed = Vec::new();
    for (key, answer) in &answers {
        let code = answer.as_ref().map_or(0, |s| s.as_u16());
        *by_status.entry(code).or_insert(0) += 1;
        if code == 201 {
            placed.push(key.clone());
        }
    }
    tally("order flood", &by_status, started.elapsed(), &[0, 201, 503]);
    // Each admitted connection (48) carries a request; at most 32 are in flight at once.
    assert!(placed.len() >= 16, "{by_status:?}");
    let legit_status = legit_during
        .context("the order from elsewhere during the flood")?
        .status();
    assert!(
        legit_status == StatusCode::CREATED || legit_status == StatusCode::SERVICE_UNAVAILABLE,
        "{legit_status}"
    );
    let stored: Vec<(String, i64)> = sqlx::query_as(
        "SELECT o.customer_id,
                (SELECT count(*) FROM outbox o2 WHERE o2.aggregate_id = o.order_id::text
                   AND o2.event_type = 'order.placed')
         FROM orders o WHERE o.customer_id LIKE 'flood-%'",
    )
    .fetch_all(&env.pool)
    .await?;
    let mut stored_keys: Vec<String> = stored.iter().map(|(k, _)| k.clone()).collect();
    stored_keys.sort();
    placed.sort();
    assert_eq!(
        stored_keys, placed,
        "orders stored against orders answered 201"
    );
    assert!(
        stored.iter().all(|(_, events)| *events == 1),
        "one placed event each"
    );

    // 3. Oversized and malformed bodies: a clear 4xx, and the service still answers.
    let huge = "x".repeat(1 << 20);
    let reply = legit
        .post(format!("{base}/orders"))
        .header("content-type", "application/json")
        .body(format!("{{\"customer_id\": \"{huge}\"}}"))
        .send()
        .await
        .context("an oversized body")?;
    assert_eq!(reply.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let reply = legit
        .post(format!("{base}/orders"))
        .header("content-type", "application/json")
        .body("{\"customer_id\": ")
        .send()
        .await
        .context("a malformed body after the oversized one")?;
    assert_eq!(
        reply.status(),
        StatusCode::BAD_REQUEST,
        "{:?}",
        reply.text().await
    );
    let reply = place(legit.clone(), "legit-after".to_owned())
        .await
        .context("an order after the bad bodies")?;
    assert_eq!(reply.status(), StatusCode::CREATED);

    // 4. A relay's ops endpoint, under its own flags: idle sockets are closed after the
    //    header-read timeout, one address cannot take every connection, /metrics still answers.
    let (_relay, metrics) = env
        .relay_with_args(
            "hostile",
            &[
                "--http-header-read-timeout",
                "2s",
                "--http-max-connections-per-client",
                "8",
            ],
        )
        .await?;
    let ops: std::net::SocketAddr = metrics.parse()?;
    let opened = Instant::now();
    let idle = hold_sockets(ops, "127.0.0.5", 8, b"").await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut beyond = hold_sockets(ops, "127.0.0.5", 1, b"").await?.remove(0);
    let mut refusal = String::new();
    tokio::time::timeout(Duration::from_secs(3), beyond.read_to_string(&mut refusal)).await??;
    assert!(refusal.starts_with("HTTP/1.1 503"), "{refusal}");
    let scrape = legit
        .get(format!("http://{metrics}/metrics"))
        .send()
        .await?;
    assert_eq!(scrape.status(), StatusCode::OK);
    let held = all_closed(idle, opened, Duration::from_secs(12)).await?;
    println!("relay ops endpoint: 8 idle sockets closed after {held:?}");
    assert!(held >= Duration::from_millis(1_500), "{held:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_client_and_no_log_line_sees_a_database_password() -> anyhow::Result<()> {
    let env = TestEnv::new("hostile_secrets", 1).await?;
    // The password wherever a URL or the environment can carry it (the server trusts local
    // connections, so the right one is not needed): the URL's user part, its query, the
    // environment, and an unreachable group database's URL.
    let url = env.database_url.replacen(
        "postgres://postgres@",
        "postgres://postgres:hunter2-user@",
        1,
    ) + "&password=hunter2-query";
    let unreachable = "gx=postgres://nobody:hunter2-gx@127.0.0.1:9/none?sslmode=disable\
                       &connect_timeout=1&password=hunter2-gxq";
    let Console {
        service,
        base,
        viewer_password,
    } = console(
        &env,
        &["--group-database", unreachable],
        &[
            ("DATABASE_URL", url.as_str()),
            ("PGPASSWORD", "hunter2-env"),
        ],
    )
    .await?;
    let http = client_from([127, 0, 0, 1])?;
    let cookie = login(&http, &base, "vic", &viewer_password).await?;
    let mut answers = Vec::new();
    for path in [
        "/api/dead-letters?group=nosuch",
        "/api/dead-letters?group=gx",
        "/dead-letters?group=gx",
        "/api/groups",
        "/groups",
        "/outbox",
        "/api/timeline?id=order-1",
        "/api/overview",
        "/",
    ] {
        let reply = http
            .get(format!("{base}{path}"))
            .header("cookie", &cookie)
            .send()
            .await?;
        let status = reply.status();
        let body = reply.text().await?;
        assert!(!body.contains("hunter2"), "{path}: {status}: {body}");
        answers.push((path, status));
    }
    println!("answers: {answers:?}");
    // The unreachable group database is a 503 with a reference (as is every read that lists
    // the groups of each database, that of an unknown name included); the outbox's database
    // answers.
    assert!(answers.contains(&(
        "/api/dead-letters?group=gx",
        StatusCode::SERVICE_UNAVAILABLE
    )));
    assert!(answers.contains(&("/outbox", StatusCode::OK)));
    let log = service.log();
    assert!(
        !log.contains("hunter2"),
        "a password in the console's log:\n{log}"
    );
    assert!(
        log.contains("reference"),
        "the refusal's detail is logged:\n{log}"
    );
    Ok(())
}

#[tokio::test]
async fn the_commands_tables_escape_what_services_wrote() -> anyhow::Result<()> {
    let env = TestEnv::new("hostile_cli", 1).await?;
    // A schedule written past the outbox's checks (which refuse control characters in event
    // types) with an escape sequence in its aggregate id, as any writer of the table could.
    let _ = sqlx::query(
        "INSERT INTO outbox_schedule (name, cron, time_zone, event_type, aggregate_id, topic,
                                      payload, missed, enabled, next_fire_at)
         VALUES ('nightly', '0 3 * * *', 'UTC', 'report.due', E'agg\\x1b[2J\\x1b[31mRED', $1,
                 '{}', 'skip', true, now() + interval '1 day')",
    )
    .bind(&env.topic)
    .execute(&env.pool)
    .await?;
    let output = std::process::Command::new(pipeline_testkit::bin_dir().join("pipeline"))
        .args(["schedules", "list"])
        .env("DATABASE_URL", &env.database_url)
        .env("KAFKA_BROKERS", &env.brokers)
        .output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("nightly"), "{stdout}");
    assert!(
        !stdout.contains('\u{1b}'),
        "an escape byte reached the terminal:\n{stdout}"
    );
    assert!(stdout.contains("RED"), "{stdout}");
    Ok(())
}

/// Runs `pipeline ARGS` against `env`'s database with no actor anywhere (no `--actor`,
/// `$PIPELINE_ACTOR` or `$USER`); returns its exit code and standard error.
fn pipeline_without_actor(env: &TestEnv, args: &[&str]) -> anyhow::Result<(Option<i32>, String)> {
    let out = std::process::Command::new(pipeline_testkit::bin_dir().join("pipeline"))
        .args(args)
        .env("DATABASE_URL", &env.database_url)
        .env("KAFKA_BROKERS", &env.brokers)
        .env_remove("USER")
        .env_remove("PIPELINE_ACTOR")
        .output()?;
    Ok((
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_names_what_is_wrong_with_a_change_before_asking_who_acts() -> anyhow::Result<()>
{
    let env = TestEnv::new("no_actor", 1).await?;
    // Bad input first: its own error, not the missing actor.
    for (args, says) in [
        (
            &[
                "schedules",
                "add",
                "nightly",
                "--cron",
                "0 61 * * *",
                "--event-type",
                "t",
                "--event-topic",
                "t",
                "--note",
                "n",
            ][..],
            "invalid cron expression",
        ),
        (
            &["schedules", "pause", "nosuch", "--note", "n"][..],
            "no schedule named",
        ),
        (&["group", "pause", "nosuch", "--note", "n"][..], "nosuch"),
        (
            &[
                "outbox",
                "requeue",
                "--event",
                "00000000-0000-0000-0000-000000000001",
                "--note",
                "n",
            ][..],
            "no outbox event",
        ),
    ] {
        let (code, stderr) = pipeline_without_actor(&env, args)?;
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(!stderr.contains("say who acts"), "{args:?}: {stderr}");
    }
    // A change that is right in itself is refused for want of an actor, and writes nothing.
    let (code, stderr) = pipeline_without_actor(
        &env,
        &[
            "schedules",
            "add",
            "nightly",
            "--cron",
            "0 3 * * *",
            "--event-type",
            "t",
            "--event-topic",
            "t",
            "--note",
            "n",
        ],
    )?;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("say who acts"), "{stderr}");
    let schedules: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_schedule")
        .fetch_one(&env.pool)
        .await?;
    assert_eq!(schedules, 0);
    Ok(())
}
