//! Transport security for a test: a certificate authority and a server certificate made with
//! `openssl`, an Apache Kafka cluster of the test's own (three nodes) with a SASL/SCRAM listener
//! over TLS, and the test server's PostgreSQL serving TLS with that certificate.
//!
//! The nodes run from the jars `scripts/test.sh` fetched (`KAFKA_JARS`, by default the scripts'
//! cache folder for the release deploy/kafka/pom.xml names) with `java` from `PATH`, in KRaft
//! mode, the users' SCRAM credentials written when their storage is formatted.

use std::fs::File;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use pipeline_core::kafka::KafkaArgs;
use rdkafka::consumer::{BaseConsumer, Consumer};
use sqlx::postgres::{PgConnectOptions, PgSslMode};
use sqlx::{Connection, PgConnection};

use crate::db::server_url;
use crate::wait::wait_until;

/// The user the brokers log in to each other as.
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

/// The nodes of a [`SecureCluster`]: three, as the verification run's and production's.
pub const NODES: usize = 3;

/// An Apache Kafka cluster of [`NODES`] KRaft nodes (each a broker and a controller) whose only
/// client listener is SASL_SSL with SCRAM-SHA-512, with the durability settings of
/// deploy/kafka/cluster.properties.in (replication factor 3, `min.insync.replicas` 2, no unclean
/// leader election); the brokers talk to each other through the same listener. Stopped when
/// dropped.
pub struct SecureCluster {
    /// Its bootstrap addresses.
    pub brokers: String,
    ca: PathBuf,
    nodes: Vec<Child>,
}

impl SecureCluster {
    /// Formats the nodes in `dir` with SCRAM credentials for `users`, starts them and waits until
    /// the first user can log in.
    pub async fn start(
        dir: &Path,
        certs: &Certificates,
        users: &[(&str, &str)],
    ) -> anyhow::Result<SecureCluster> {
        let jars = kafka_jars()?;
        let classpath = format!("{}/*", jars.display());
        let ports: Vec<(u16, u16)> = (0..NODES)
            .map(|_| Ok((free_port()?, free_port()?)))
            .collect::<anyhow::Result<_>>()?;
        let voters: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, controller))| format!("{}@127.0.0.1:{controller}", i + 1))
            .collect();
        // Each node's keystore: the key and certificate in one PEM file.
        let keystore = dir.join("broker-keystore.pem");
        let key = std::fs::read_to_string(&certs.key)?;
        let cert = std::fs::read_to_string(&certs.cert)?;
        std::fs::write(&keystore, format!("{key}{cert}"))?;
        let id = Command::new("java")
            .args(["-cp", &classpath, "kafka.tools.StorageTool", "random-uuid"])
            .output()
            .context("running java (the scripts install Java 17)")?;
        let cluster_id = String::from_utf8_lossy(&id.stdout).trim().to_owned();
        let mut nodes = Vec::with_capacity(NODES);
        for (i, (port, controller_port)) in ports.iter().enumerate() {
            let node = i + 1;
            let config = dir.join(format!("kafka-{node}.properties"));
            std::fs::write(
                &config,
                format!(
                    "process.roles=broker,controller
node.id={node}
controller.quorum.voters={voters}
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
default.replication.factor=3
min.insync.replicas=2
unclean.leader.election.enable=false
offsets.topic.replication.factor=3
offsets.topic.num.partitions=3
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
share.coordinator.state.topic.replication.factor=3
share.coordinator.state.topic.min.isr=2
group.initial.rebalance.delay.ms=0
num.network.threads=2
num.io.threads=2
",
                    BROKER_USER.0,
                    BROKER_USER.1,
                    keystore.display(),
                    certs.ca.display(),
                    dir.join(format!("kafka-{node}-data")).display(),
                    voters = voters.join(","),
                ),
            )?;
            let log_path = dir.join(format!("kafka-{node}.log"));
            let log = File::create(&log_path)?;
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
                .context("formatting a secure node's storage")?;
            if !formatted.success() {
                bail!(
                    "formatting secure node {node} failed (see {})",
                    log_path.display()
                );
            }
            nodes.push(
                Command::new("java")
                    .args(["-Xmx256m", "-cp", &classpath, "kafka.Kafka"])
                    .arg(&config)
                    .stdin(Stdio::null())
                    .stdout(log.try_clone()?)
                    .stderr(log)
                    .spawn()
                    .context("starting a secure Kafka node")?,
            );
        }
        let brokers: Vec<String> = ports
            .iter()
            .map(|(p, _)| format!("127.0.0.1:{p}"))
            .collect();
        let cluster = SecureCluster {
            brokers: brokers.join(","),
            ca: certs.ca.clone(),
            nodes,
        };
        let (user, password) = users.first().copied().unwrap_or(BROKER_USER);
        let config = cluster.client(user, password).client_config();
        wait_until(
            "every secure node to let a client in",
            Duration::from_secs(120),
            || {
                let config = config.clone();
                async move {
                    let admitted = tokio::task::spawn_blocking(move || {
                        let client: BaseConsumer = config.create()?;
                        let metadata = client.fetch_metadata(None, Duration::from_secs(2))?;
                        anyhow::Ok(metadata.brokers().len() == NODES)
                    })
                    .await?
                    .unwrap_or(false);
                    Ok(admitted.then_some(()))
                }
            },
        )
        .await?;
        Ok(cluster)
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

impl Drop for SecureCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            let _ = node.kill();
            let _ = node.wait();
        }
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
        // The reload is asynchronous: wait until the server answers over TLS with the new
        // certificate, checked against the authority and the name.
        let probe: PgConnectOptions = server.parse()?;
        let probe = probe
            .host("localhost")
            .ssl_mode(PgSslMode::VerifyFull)
            .ssl_root_cert(&certs.ca);
        wait_until(
            "PostgreSQL serving the test certificate",
            Duration::from_secs(30),
            || {
                let probe = probe.clone();
                async move { Ok(PgConnection::connect_with(&probe).await.ok().map(drop)) }
            },
        )
        .await?;
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
