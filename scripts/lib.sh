# shellcheck shell=bash
# Helpers shared by scripts/test.sh and scripts/run-pipeline.sh. Source it, don't run it:
#
#   source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
#
# It brings up the local stack the pipeline needs, without docker:
#   - PostgreSQL on 127.0.0.1:5432, user postgres, trust auth (Debian's packages, pg_ctlcluster);
#   - nisshi, a Kafka-protocol broker from crates.io, on 127.0.0.1:9092;
#   - prometheus and promtool (Debian's prometheus package), for the monitoring checks.
#
# Settings (environment):
#   RUN_DIR                logs and pid files            (default: <repo>/.run, git-ignored)
#   PG_WAIT_SECONDS        how long to wait for PostgreSQL to accept connections (default 60)
#   NISSHI_VERSION         version `cargo install` builds when nisshi is missing (default 0.8.1;
#                          empty = newest)
#   NISSHI_INSTALL_WAIT    how long to wait for a `cargo install nisshi` already running (default 1800 s)
#   BROKER_STORAGE         nisshi storage engine URL (default memory://nisshi/), e.g.
#                          postgres://postgres@127.0.0.1:5432/nisshi?sslmode=disable
#   BROKER_WAIT_SECONDS    how long to wait for the broker's port (default 60)
#   BROKER_LOG_LEVEL       RUST_LOG given to nisshi (default warn; info logs every request); our RUST_LOG is not passed on

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
BROKER_STORAGE="${BROKER_STORAGE:-memory://nisshi/}"
NISSHI_VERSION="${NISSHI_VERSION-0.8.1}"

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
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
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
    local wait_s="${PG_WAIT_SECONDS:-60}" fresh=0 started=0 ver='' cluster=''
    if ! pg_accepting; then
        if ! have pg_ctlcluster || [[ -z $(pg_server_version) ]]; then
            install_postgres
            fresh=1
        fi
        local line ver cluster _port status
        line=$(pg_lsclusters -h 2>/dev/null | awk -v p="$PG_PORT" '$3 == p { print; exit }')
        if [[ -z $line ]]; then
            if [[ -n $(pg_lsclusters -h 2>/dev/null) ]]; then
                pg_lsclusters >&2 || true
                die "there are PostgreSQL clusters, but none on port $PG_PORT"
            fi
            ver=$(pg_server_version)
            log "creating PostgreSQL cluster $ver/main on port $PG_PORT"
            as_root pg_createcluster "$ver" main --port "$PG_PORT" >/dev/null
            fresh=1
            line=$(pg_lsclusters -h | awk -v p="$PG_PORT" '$3 == p { print; exit }')
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
            as_root pg_ctlcluster --skip-systemctl-redirect "$ver" "$cluster" start ||
                die "pg_ctlcluster could not start $ver/$cluster (see /var/log/postgresql/postgresql-$ver-$cluster.log)"
        fi
        local deadline=$((SECONDS + wait_s))
        until pg_accepting; do
            ((SECONDS < deadline)) ||
                die "PostgreSQL $ver/$cluster does not accept connections on $PG_HOST:$PG_PORT after ${wait_s}s (see /var/log/postgresql/postgresql-$ver-$cluster.log)"
            sleep 1
        done
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
}

# ensure_autovacuum — PostgreSQL's default, but some machines' servers come with it off. The
# relay's queue table and the consumers' progress rows are rewritten all the time; without
# vacuum their dead versions pile up and every lookup wades through them (seen: 85 buffer reads to
# find two order_progress rows).
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

# ---------------------------------------------------------------------------------------------
# nisshi (Kafka-protocol broker)

# ensure_nisshi — the nisshi binary on PATH ($HOME/.cargo/bin), built with cargo install when missing.
ensure_nisshi() {
    if have nisshi; then
        log "nisshi: $(command -v nisshi)"
        return 0
    fi
    # A `cargo install nisshi` already under way (another script, a setup step): wait for it
    # rather than building the same thing twice on two cores.
    local waited=0 limit="${NISSHI_INSTALL_WAIT:-1800}"
    while pgrep -f 'cargo(-[0-9.]+)? install .*nisshi' >/dev/null 2>&1; do
        if ((waited == 0)); then
            log "a 'cargo install nisshi' is already running: waiting for it (up to ${limit}s)"
        fi
        ((waited < limit)) || die "'cargo install nisshi' still running after ${limit}s"
        sleep 10
        waited=$((waited + 10))
    done
    if have nisshi; then
        log "nisshi: $(command -v nisshi)"
        return 0
    fi
    local version_args=()
    if [[ -n $NISSHI_VERSION ]]; then
        version_args=(--version "$NISSHI_VERSION")
    fi
    log "nisshi not found: cargo install --locked --ignore-rust-version nisshi ${NISSHI_VERSION:+$NISSHI_VERSION }(about 11 minutes on 2 cores)"
    local started=$SECONDS
    cargo install --locked --ignore-rust-version "${version_args[@]}" nisshi ||
        die "cargo install nisshi failed"
    hash -r
    have nisshi || die "cargo install nisshi succeeded but nisshi is not on PATH ($HOME/.cargo/bin)"
    log "nisshi installed in $(human_duration $((SECONDS - started)))"
}

# The database a postgres:// storage URL on our local server names, or nothing.
_broker_storage_local_db() {
    [[ $BROKER_STORAGE =~ ^postgres(ql)?://[^/]*@?(127\.0\.0\.1|localhost)(:5432)?/([A-Za-z_][A-Za-z0-9_]*) ]] &&
        printf '%s\n' "${BASH_REMATCH[4]}"
}

# ensure_broker — a Kafka-protocol broker on 127.0.0.1:9092. When nothing listens there, installs
# nisshi if missing (ensure_nisshi), starts it in the background (log $RUN_DIR/nisshi.log, pid
# $RUN_DIR/nisshi.pid) and sets BROKER_STARTED=1; stop it with stop_broker.
ensure_broker() {
    if port_open "$BROKER_HOST" "$BROKER_PORT"; then
        log "using the broker already listening on $BROKER_HOST:$BROKER_PORT (not started by this script, left running)"
        return 0
    fi
    ensure_nisshi
    local db
    if db=$(_broker_storage_local_db); then
        create_database "$db"
    fi
    local url="tcp://$BROKER_HOST:$BROKER_PORT"
    log "starting nisshi on $url, storage ${BROKER_STORAGE%%\?*} (log: $RUN_DIR/nisshi.log)"
    # Run from $RUN_DIR: nisshi loads a .env file from its working directory (or a parent).
    (
        cd "$RUN_DIR"
        exec env RUST_LOG="${BROKER_LOG_LEVEL:-warn}" nisshi broker \
            --listener-url "$url" \
            --advertised-listener-url "$url" \
            --storage-engine "$BROKER_STORAGE"
    ) >"$RUN_DIR/nisshi.log" 2>&1 </dev/null &
    BROKER_PID=$!
    BROKER_STARTED=1
    echo "$BROKER_PID" >"$RUN_DIR/nisshi.pid"
    local wait_s="${BROKER_WAIT_SECONDS:-60}"
    local deadline=$((SECONDS + wait_s))
    until port_open "$BROKER_HOST" "$BROKER_PORT"; do
        if ! pid_alive "$BROKER_PID"; then
            BROKER_STARTED=0
            rm -f "$RUN_DIR/nisshi.pid"
            tail -n 30 "$RUN_DIR/nisshi.log" >&2 || true
            die "nisshi exited before listening on $url (log above, full log in $RUN_DIR/nisshi.log)"
        fi
        if ((SECONDS >= deadline)); then
            tail -n 30 "$RUN_DIR/nisshi.log" >&2 || true
            die "nisshi does not listen on $url after ${wait_s}s"
        fi
        sleep 0.5
    done
    log "broker up on $BROKER_HOST:$BROKER_PORT (nisshi pid $BROKER_PID)"
}

# stop_broker — stops the broker ensure_broker started (no-op otherwise).
stop_broker() {
    if ((BROKER_STARTED)) && [[ -n $BROKER_PID ]]; then
        if pid_alive "$BROKER_PID"; then
            log "stopping nisshi (pid $BROKER_PID)"
            stop_pid nisshi "$BROKER_PID" 15 || true
        fi
        rm -f "$RUN_DIR/nisshi.pid"
        BROKER_STARTED=0
    fi
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
