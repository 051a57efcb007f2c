//! Transport security for a test: a certificate authority and a server certificate made with
//! `openssl`, an Apache Kafka node of the test's own with a SASL/SCRAM listener over TLS, and the
//! test server's PostgreSQL serving TLS with that certificate.
//!
//! The node runs from the jars `scripts/test.sh` fetched (`KAFKA_JARS`, by default the scripts'
//! cache folder for the release deploy/kafka/pom.xml names) with `java` from `PATH`, in KRaft
//! mode, its users' SCRAM credentials written when its storage is formatted.

use std::fs::File;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use pipeline_core::kafka::KafkaArgs;
use rdkafka::consumer::{BaseConsumer, Consumer};
use sqlx::{Connection, PgConnection};

use crate::db::server_url;
use crate::wait::wait_until;

/// The user the node's brokers log in to each other as.
const BROKER_USER: (&str, &str) = ("broker", "broker-secret");

/// A certificate authority and a server certificate it signed for `localhost` and 127.0.0.1.
pub struct Certificates {
    /// The authority's certificate: what clients trust.
    pub ca: PathBuf,
    /// The server's certificate (PEM).
    pub cert: PathBuf,
    /// The server's private key (PKCS#8 PEM, unencrypted).
    pub key: PathBuf,
}

impl Certificates {
    /// Makes them in `dir` with the `openssl` command.
    pub fn make(dir: &Path) -> anyhow::Result<Certificates> {
        std::fs::create_dir_all(dir)?;
        let path = |name: &str| dir.join(name).display().to_string();
        std::fs::write(
            dir.join("san.cnf"),
            "subjectAltName=DNS:localhost,IP:127.0.0.1\n",
        )?;
        let steps: [&[&str]; 3] = [
            &[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                "-subj",
                "/CN=pipeline test authority",
                "-keyout",
                &path("ca.key"),
                "-out",
                &path("ca.pem"),
            ],
            &[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-subj",
                "/CN=localhost",
                "-keyout",
                &path("server.key"),
                "-out",
                &path("server.csr"),
            ],
            &[
                "x509",
                "-req",
                "-in",
                &path("server.csr"),
                "-CA",
                &path("ca.pem"),
                "-CAkey",
                &path("ca.key"),
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                &path("san.cnf"),
                "-out",
                &path("server.pem"),
            ],
        ];
        for args in steps {
            let out = Command::new("openssl")
                .args(args)
                .output()
                .context("running openssl (Debian: apt-get install openssl)")?;
            if !out.status.success() {
                bail!(
                    "openssl {} failed: {}",
                    args[0],
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        Ok(Certificates {
            ca: dir.join("ca.pem"),
            cert: dir.join("server.pem"),
            key: dir.join("server.key"),
        })
    }
}

/// A one-node Apache Kafka cluster whose only client listener is SASL_SSL with SCRAM-SHA-512;
/// stopped when dropped.
pub struct SecureBroker {
    /// Its bootstrap address.
    pub brokers: String,
    ca: PathBuf,
    child: Child,
}

impl SecureBroker {
    /// Formats a node in `dir` with SCRAM credentials for `users`, starts it and waits until
    /// the first of them can log in.
    pub async fn start(
        dir: &Path,
        certs: &Certificates,
        users: &[(&str, &str)],
    ) -> anyhow::Result<SecureBroker> {
        let jars = kafka_jars()?;
        let classpath = format!("{}/*", jars.display());
        let (port, controller_port) = (free_port()?, free_port()?);
        // The node's keystore: its key and certificate in one PEM file.
        let keystore = dir.join("broker-keystore.pem");
        let key = std::fs::read_to_string(&certs.key)?;
        let cert = std::fs::read_to_string(&certs.cert)?;
        std::fs::write(&keystore, format!("{key}{cert}"))?;
        let data = dir.join("kafka-data");
        let config = dir.join("broker.properties");
        std::fs::write(
            &config,
            format!(
                "process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:{controller_port}
controller.listener.names=CONTROLLER
listeners=SASL_SSL://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}
advertised.listeners=SASL_SSL://127.0.0.1:{port}
listener.security.protocol.map=SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT
inter.broker.listener.name=SASL_SSL
sasl.enabled.mechanisms=SCRAM-SHA-512
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username=\"{}\" password=\"{}\";
ssl.keystore.type=PEM
ssl.keystore.location={}
ssl.truststore.type=PEM
ssl.truststore.location={}
log.dirs={}
offsets.topic.replication.factor=1
offsets.topic.num.partitions=3
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
",
                BROKER_USER.0,
                BROKER_USER.1,
                keystore.display(),
                certs.ca.display(),
                data.display()
            ),
        )?;
        let log = File::create(dir.join("kafka.log"))?;
        let id = Command::new("java")
            .args(["-cp", &classpath, "kafka.tools.StorageTool", "random-uuid"])
            .output()
            .context("running java (the scripts install Java 17)")?;
        let cluster_id = String::from_utf8_lossy(&id.stdout).trim().to_owned();
        let mut format = Command::new("java");
        let _ = format
            .args(["-cp", &classpath, "kafka.tools.StorageTool", "format"])
            .args(["--cluster-id", &cluster_id, "--config"])
            .arg(&config);
        for (user, password) in std::iter::once(&BROKER_USER).chain(users) {
            let _ = format.args([
                "--add-scram",
                &format!("SCRAM-SHA-512=[name={user},password={password}]"),
            ]);
        }
        let formatted = format
            .stdout(log.try_clone()?)
            .stderr(log.try_clone()?)
            .status()
            .context("formatting the secure node's storage")?;
        if !formatted.success() {
            bail!(
                "formatting the secure node failed (see {})",
                dir.join("kafka.log").display()
            );
        }
        let child = Command::new("java")
            .args(["-Xmx384m", "-cp", &classpath, "kafka.Kafka"])
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting the secure Kafka node")?;
        let broker = SecureBroker {
            brokers: format!("127.0.0.1:{port}"),
            ca: certs.ca.clone(),
            child,
        };
        let (user, password) = users.first().copied().unwrap_or(BROKER_USER);
        let config = broker.client(user, password).client_config();
        wait_until(
            "the secure node to let a client in",
            Duration::from_secs(90),
            || {
                let config = config.clone();
                async move {
                    let admitted = tokio::task::spawn_blocking(move || {
                        let client: BaseConsumer = config.create()?;
                        anyhow::Ok(client.fetch_metadata(None, Duration::from_secs(2)).is_ok())
                    })
                    .await??;
                    Ok(admitted.then_some(()))
                }
            },
        )
        .await?;
        Ok(broker)
    }

    /// `KAFKA_OPTIONS` for `user` with `password`: SASL_SSL, SCRAM-SHA-512, the test authority.
    pub fn options(&self, user: &str, password: &str) -> Vec<(String, String)> {
        [
            ("security.protocol", "SASL_SSL".to_owned()),
            ("sasl.mechanisms", "SCRAM-SHA-512".to_owned()),
            ("sasl.username", user.to_owned()),
            ("sasl.password", password.to_owned()),
            ("ssl.ca.location", self.ca.display().to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    /// Client settings for `user` with `password`.
    pub fn client(&self, user: &str, password: &str) -> KafkaArgs {
        KafkaArgs {
            kafka_brokers: self.brokers.clone(),
            kafka_options: self.options(user, password),
        }
    }
}

impl Drop for SecureBroker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The folder of Kafka's jars: `KAFKA_JARS`, else the scripts' cache folder for the release
/// deploy/kafka/pom.xml names.
fn kafka_jars() -> anyhow::Result<PathBuf> {
    if let Ok(dir) = std::env::var("KAFKA_JARS") {
        return Ok(PathBuf::from(dir));
    }
    let pom = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kafka/pom.xml");
    let pom =
        std::fs::read_to_string(&pom).with_context(|| format!("reading {}", pom.display()))?;
    let version = pom
        .split("<kafka.version>")
        .nth(1)
        .and_then(|rest| rest.split('<').next())
        .context("deploy/kafka/pom.xml names no kafka.version")?;
    let cache = std::env::var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|_| std::env::var("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .context("neither XDG_CACHE_HOME nor HOME is set: set KAFKA_JARS")?;
    let dir = cache.join("pipeline").join(format!("kafka-{version}"));
    if !dir.is_dir() {
        bail!(
            "{} is missing: scripts/kafka.sh fetch fills it (or set KAFKA_JARS)",
            dir.display()
        );
    }
    Ok(dir)
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The test server serving TLS with a certificate of the test's authority, for as long as this
/// lives (then its own settings again). The certificate and key are written into the server's
/// data directory by the server itself (`COPY … TO`, so they belong to its user with the mode
/// it requires), and the server reloads its configuration.
pub struct PostgresTls {
    server: String,
}

impl PostgresTls {
    /// Serves TLS with `certs`' server certificate.
    pub async fn serve(certs: &Certificates) -> anyhow::Result<PostgresTls> {
        let server = server_url();
        let mut conn = PgConnection::connect(&server).await?;
        let data: String = sqlx::query_scalar("SELECT current_setting('data_directory')")
            .fetch_one(&mut conn)
            .await?;
        for (source, name) in [
            (&certs.cert, "pipeline-test-server.pem"),
            (&certs.key, "pipeline-test-server.key"),
        ] {
            let text = std::fs::read_to_string(source)?;
            if text.contains('\'') || text.contains('\\') {
                bail!(
                    "{} holds characters a COPY literal cannot",
                    source.display()
                );
            }
            let lines: Vec<String> = text.lines().map(|l| format!("('{l}')")).collect();
            let target = format!("{data}/{name}");
            sqlx::raw_sql(&format!(
                "COPY (SELECT l FROM (VALUES {}) AS v(l)) TO '{target}'",
                lines.join(",")
            ))
            .execute(&mut conn)
            .await
            .with_context(|| format!("writing {target}"))?;
        }
        // One statement at a time: ALTER SYSTEM cannot run in a transaction block.
        for statement in [
            "ALTER SYSTEM SET ssl = on".to_owned(),
            format!("ALTER SYSTEM SET ssl_cert_file = '{data}/pipeline-test-server.pem'"),
            format!("ALTER SYSTEM SET ssl_key_file = '{data}/pipeline-test-server.key'"),
            "SELECT pg_reload_conf()".to_owned(),
        ] {
            sqlx::raw_sql(&statement).execute(&mut conn).await?;
        }
        Ok(PostgresTls { server })
    }
}

impl Drop for PostgresTls {
    fn drop(&mut self) {
        let server = self.server.clone();
        let reset = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async {
                let mut conn = PgConnection::connect(&server).await?;
                for statement in [
                    "ALTER SYSTEM RESET ssl",
                    "ALTER SYSTEM RESET ssl_cert_file",
                    "ALTER SYSTEM RESET ssl_key_file",
                    "SELECT pg_reload_conf()",
                ] {
                    sqlx::raw_sql(statement).execute(&mut conn).await?;
                }
                anyhow::Ok(())
            })
        })
        .join();
        if let Ok(Err(e)) = reset {
            eprintln!("giving the test server its own TLS settings back: {e:#}");
        }
    }
}
