#!/usr/bin/env bash
# Make sure the services used by the integration tests are reachable on
# 127.0.0.1, starting (or, as root with apt-get, installing) them if needed.
#
# Usage: scripts/services.sh
#            [postgres|mariadb|redis|rabbitmq|sqs|nats|prometheus|kcat|chromium ...]
#        (default: all nine)
#
# For a service that is down, the script tries in order: start the locally
# installed server; `docker compose up -d <service>` if a Docker engine is
# running; install the package with apt-get when running as root. The SQS
# emulator (fauxqs) is installed with `npm install -g` before trying Docker;
# its log goes to $TMPDIR/fauxqs.log (default /tmp). NATS is started with
# JetStream (-js); as root its store is /var/lib/nats-server and its log
# /var/log/nats-server.log, otherwise both are under $TMPDIR. MariaDB is
# Debian's mariadbd (MySQL 8 serves as well), with the database test that
# root reaches over 127.0.0.1 without a password.
#
# prometheus is only installed (Debian's package, as root with apt-get),
# never started: the tests that need it start a private server on a free
# port. Its package would start a system Prometheus on :9090; a
# policy-rc.d that denies starts during the install prevents that, and on
# a machine booted with systemd the unit is disabled as well.
#
# kcat is a command-line Kafka client, not a service: it is only installed
# (Debian's package, as root with apt-get). The Kafka adapter's tests run
# it to produce records as a producer that is not Watermill would, into
# their own in-process broker.
#
# chromium is a browser, not a service: it is only installed (Debian's
# package, as root with apt-get), never started. The console's browser
# test starts a headless Chromium of its own, on a fresh profile, and
# drives the operator console with it.
#
# Environment:
#   ONCEMILL_TEST_DATABASE_URL, DATABASE_URL
#                     if set (first one wins, as in the tests), only check that
#                     this PostgreSQL is reachable; start nothing locally
#   ONCEMILL_TEST_MYSQL_DSN
#                     if set (as in the tests), only check that the tcp(host:port)
#                     it names answers; start nothing locally
#   SERVICES_TIMEOUT  seconds to wait for each service (default 60)
#   CI                when set (CI=true), exit non-zero if a service is
#                     unreachable; otherwise only warn (the tests then skip
#                     what they cannot reach, and fail under CI)
#
# Running it again while everything is up changes nothing.
set -euo pipefail

HOST=127.0.0.1
PG_PORT=5432
REDIS_PORT=6379
RABBITMQ_PORT=5672
SQS_PORT=4566
NATS_PORT=4222
MYSQL_PORT=3306
FAUXQS_VERSION=1.9.2
TIMEOUT=${SERVICES_TIMEOUT:-60}
LOG_DIR=${TMPDIR:-/tmp}

cd "$(dirname "${BASH_SOURCE[0]}")/.."

have() { command -v "$1" >/dev/null 2>&1; }

is_root() { [ "$(id -u)" -eq 0 ]; }

tcp_open() { timeout 2 bash -c ">/dev/tcp/$1/$2" 2>/dev/null; }

# wait_for SECONDS CMD...: poll CMD once a second until it succeeds.
wait_for() {
    local deadline=$((SECONDS + $1))
    shift
    until "$@"; do
        [ "$SECONDS" -lt "$deadline" ] || return 1
        sleep 1
    done
}

DOCKER_STATE=unknown
docker_engine() {
    if [ "$DOCKER_STATE" = unknown ]; then
        DOCKER_STATE=no
        if have docker && timeout 10 docker info >/dev/null 2>&1 &&
            docker compose version >/dev/null 2>&1; then
            DOCKER_STATE=yes
        fi
    fi
    [ "$DOCKER_STATE" = yes ]
}

APT_UPDATED=no
apt_install() {
    local log="$LOG_DIR/services-apt.log"
    is_root && have apt-get || return 1
    export DEBIAN_FRONTEND=noninteractive
    if [ "$APT_UPDATED" = no ]; then
        apt-get update >>"$log" 2>&1 || { echo "apt-get update failed, see $log" >&2; return 1; }
        APT_UPDATED=yes
    fi
    apt-get install -y --no-install-recommends "$@" >>"$log" 2>&1 ||
        { echo "apt-get install $* failed, see $log" >&2; return 1; }
}

compose_up() {
    docker_engine || return 1
    docker compose up -d "$1" >&2 || return 1
}

# ---------------------------------------------------------------- postgres

pg_up() {
    if have pg_isready; then
        pg_isready -q -h "$HOST" -p "$PG_PORT" -t 2
    else
        tcp_open "$HOST" "$PG_PORT"
    fi
}

pg_installed() { have pg_ctlcluster && [ -n "$(ls /etc/postgresql 2>/dev/null)" ]; }

pg_start_local() {
    local version
    version=$(find /etc/postgresql -mindepth 1 -maxdepth 1 -printf '%f\n' | sort -V | tail -n 1)
    pg_ctlcluster --skip-systemctl-redirect "$version" main start >&2 || pg_up
}

as_postgres() { su postgres -s /bin/sh -c "PGPORT=$PG_PORT $1"; }

# Local cluster only: trust auth on 127.0.0.1, a role for the current user
# and the database "test". Does nothing when the test database is already
# reachable without a password.
pg_setup() {
    local user notes=() hba
    user=$(id -un)
    if have psql && psql -h "$HOST" -p "$PG_PORT" -U postgres -d test -w -Atqc 'select 1' >/dev/null 2>&1 &&
        psql -h "$HOST" -p "$PG_PORT" -d test -w -Atqc 'select 1' >/dev/null 2>&1; then
        return 0
    fi
    if ! is_root || ! pg_installed || ! have psql; then
        PG_NOTES="cannot connect to database test as postgres/$user without a password; set DATABASE_URL"
        return 1
    fi
    hba=$(as_postgres "psql -Atqc 'show hba_file'") || return 1
    if ! grep -Eq "^[[:space:]]*host[[:space:]]+all[[:space:]]+all[[:space:]]+$HOST/32[[:space:]]+trust" "$hba"; then
        # The first matching line wins, so put the trust line before all other host lines.
        awk -v line="host all all $HOST/32 trust" \
            '!done && /^[[:space:]]*host/ { print line; done = 1 } { print } END { if (!done) print line }' \
            "$hba" >"$hba.tmp" && cat "$hba.tmp" >"$hba" && rm -f "$hba.tmp"
        as_postgres "psql -Atqc 'select pg_reload_conf()'" >/dev/null
        notes+=("trust auth enabled for $HOST")
    fi
    if [ "$user" != postgres ] &&
        [ -z "$(as_postgres "psql -Atqc \"select 1 from pg_roles where rolname = '$user'\"")" ]; then
        as_postgres "createuser --superuser '$user'"
        notes+=("role $user created")
    fi
    if [ -z "$(as_postgres "psql -Atqc \"select 1 from pg_database where datname = 'test'\"")" ]; then
        as_postgres "createdb test"
        notes+=("database test created")
    fi
    if [ ${#notes[@]} -gt 0 ]; then
        PG_NOTES=$(printf '%s, ' "${notes[@]}")
        PG_NOTES=${PG_NOTES%, }
    fi
    psql -h "$HOST" -p "$PG_PORT" -U postgres -d test -w -Atqc 'select 1' >/dev/null
}

ensure_postgres() {
    local what
    local url_var=
    PG_NOTES=
    if [ -n "${ONCEMILL_TEST_DATABASE_URL:-}" ]; then
        url_var=ONCEMILL_TEST_DATABASE_URL
    elif [ -n "${DATABASE_URL:-}" ]; then
        url_var=DATABASE_URL
    fi
    if [ -n "$url_var" ]; then
        if pg_isready -q -d "${!url_var}" -t 5; then
            echo "postgres: $url_var is reachable"
            return 0
        fi
        echo "postgres: $url_var is not reachable (not starting a local server)"
        return 1
    fi
    if pg_up; then
        what="running at $HOST:$PG_PORT"
    elif pg_installed; then
        if ! { pg_start_local && wait_for "$TIMEOUT" pg_up; }; then
            echo "postgres: failed to start"
            return 1
        fi
        what=started
    elif compose_up postgres; then
        wait_for "$TIMEOUT" pg_up || { echo "postgres: docker compose container not ready"; return 1; }
        echo "postgres: started with docker compose"
        return 0
    elif apt_install postgresql; then
        wait_for 5 pg_up || pg_start_local
        wait_for "$TIMEOUT" pg_up || { echo "postgres: installed but failed to start"; return 1; }
        what="installed and started"
    else
        echo "postgres: not running and not installed (install postgresql, or run: docker compose up -d postgres)"
        return 1
    fi
    if ! pg_setup; then
        echo "postgres: $what, but ${PG_NOTES:-setting up database test failed}"
        return 1
    fi
    echo "postgres: $what${PG_NOTES:+ ($PG_NOTES)}"
}

# ----------------------------------------------------------------- mariadb

mariadb_client() {
    if have mariadb; then
        echo mariadb
    elif have mysql; then
        echo mysql
    else
        return 1
    fi
}

# The tests' login: root over TCP without a password, database test.
mariadb_login() {
    local client
    client=$(mariadb_client) || { tcp_open "$HOST" "$MYSQL_PORT"; return; }
    "$client" -h "$HOST" -P "$MYSQL_PORT" -u root --connect-timeout=2 -e 'SELECT 1' test >/dev/null 2>&1
}

mariadb_up() { tcp_open "$HOST" "$MYSQL_PORT"; }

mariadb_bin() {
    local bin
    for bin in /usr/sbin/mariadbd /usr/sbin/mysqld; do
        [ -x "$bin" ] && { echo "$bin"; return 0; }
    done
    return 1
}

mariadb_start_local() {
    local bin
    bin=$(mariadb_bin) || return 1
    is_root || return 1
    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld 2>/dev/null || true
    start-stop-daemon --start --oknodo --background --exec "$bin" >&2
}

# Local server only: the database test, and root's passwordless login over
# TCP beside its socket login. Does nothing when the tests can log in.
mariadb_setup() {
    local client
    mariadb_login && return 0
    is_root && client=$(mariadb_client) || { MYSQL_NOTES="cannot log in as root over $HOST without a password; set ONCEMILL_TEST_MYSQL_DSN"; return 1; }
    "$client" -u root -e "CREATE DATABASE IF NOT EXISTS test;
        ALTER USER root@localhost IDENTIFIED VIA unix_socket OR mysql_native_password USING PASSWORD('')" >&2 || return 1
    MYSQL_NOTES="database test and root's TCP login set up"
    mariadb_login
}

ensure_mariadb() {
    local what addr
    MYSQL_NOTES=
    if [ -n "${ONCEMILL_TEST_MYSQL_DSN:-}" ]; then
        addr=$(printf '%s' "$ONCEMILL_TEST_MYSQL_DSN" | sed -n 's/.*tcp(\([^)]*\)).*/\1/p')
        if [ -n "$addr" ] && tcp_open "${addr%:*}" "${addr##*:}"; then
            echo "mariadb: ONCEMILL_TEST_MYSQL_DSN is reachable"
            return 0
        fi
        echo "mariadb: ONCEMILL_TEST_MYSQL_DSN is not reachable (not starting a local server)"
        return 1
    fi
    if mariadb_up; then
        what="running at $HOST:$MYSQL_PORT"
    elif mariadb_bin >/dev/null; then
        if ! { mariadb_start_local && wait_for "$TIMEOUT" mariadb_up; }; then
            echo "mariadb: failed to start"
            return 1
        fi
        what=started
    elif apt_install mariadb-server; then
        wait_for 10 mariadb_up || mariadb_start_local
        wait_for "$TIMEOUT" mariadb_up || { echo "mariadb: installed but failed to start"; return 1; }
        what="installed and started"
    else
        echo "mariadb: not running and not installed (install mariadb-server)"
        return 1
    fi
    if ! mariadb_setup; then
        echo "mariadb: $what, but ${MYSQL_NOTES:-logging in as root over $HOST failed}"
        return 1
    fi
    echo "mariadb: $what${MYSQL_NOTES:+ ($MYSQL_NOTES)}"
}

# ------------------------------------------------------------------- redis

redis_up() {
    if have redis-cli; then
        [ "$(timeout 2 redis-cli -h "$HOST" -p "$REDIS_PORT" ping 2>/dev/null)" = PONG ]
    else
        tcp_open "$HOST" "$REDIS_PORT"
    fi
}

redis_start_local() {
    redis-server --daemonize yes --bind "$HOST" --port "$REDIS_PORT" --save "" --appendonly no >&2
}

ensure_redis() {
    if redis_up; then
        echo "redis: running at $HOST:$REDIS_PORT"
    elif have redis-server; then
        if ! { redis_start_local && wait_for "$TIMEOUT" redis_up; }; then
            echo "redis: failed to start"
            return 1
        fi
        echo "redis: started"
    elif compose_up redis; then
        wait_for "$TIMEOUT" redis_up || { echo "redis: docker compose container not ready"; return 1; }
        echo "redis: started with docker compose"
    elif apt_install redis-server; then
        wait_for 5 redis_up || redis_start_local
        wait_for "$TIMEOUT" redis_up || { echo "redis: installed but failed to start"; return 1; }
        echo "redis: installed and started"
    else
        echo "redis: not running and not installed (install redis-server, or run: docker compose up -d redis)"
        return 1
    fi
}

# ---------------------------------------------------------------- rabbitmq

rabbitmq_up() { tcp_open "$HOST" "$RABBITMQ_PORT"; }

rabbitmq_start_local() {
    # Another start may still be booting; only start when no node answers.
    if have rabbitmqctl && timeout 15 rabbitmqctl -q status >/dev/null 2>&1; then
        return 0
    fi
    rabbitmq-server -detached >&2
}

rabbitmq_wait() {
    wait_for "$TIMEOUT" rabbitmq_up || return 1
    if have rabbitmqctl; then
        timeout "$TIMEOUT" rabbitmqctl -q await_startup --timeout "$TIMEOUT" >/dev/null 2>&1 || true
    fi
    rabbitmq_up
}

ensure_rabbitmq() {
    if rabbitmq_up; then
        echo "rabbitmq: running at $HOST:$RABBITMQ_PORT"
    elif have rabbitmq-server; then
        if ! { rabbitmq_start_local && rabbitmq_wait; }; then
            echo "rabbitmq: failed to start"
            return 1
        fi
        echo "rabbitmq: started"
    elif compose_up rabbitmq; then
        wait_for "$TIMEOUT" rabbitmq_up || { echo "rabbitmq: docker compose container not ready"; return 1; }
        echo "rabbitmq: started with docker compose"
    elif apt_install rabbitmq-server; then
        wait_for 10 rabbitmq_up || rabbitmq_start_local
        rabbitmq_wait || { echo "rabbitmq: installed but failed to start"; return 1; }
        echo "rabbitmq: installed and started"
    else
        echo "rabbitmq: not running and not installed (install rabbitmq-server, or run: docker compose up -d rabbitmq)"
        return 1
    fi
}

# --------------------------------------------------------------------- sqs

sqs_up() { tcp_open "$HOST" "$SQS_PORT"; }

sqs_start_local() {
    local log="$LOG_DIR/fauxqs.log"
    if have setsid; then
        FAUXQS_PORT=$SQS_PORT setsid nohup fauxqs </dev/null >>"$log" 2>&1 &
    else
        FAUXQS_PORT=$SQS_PORT nohup fauxqs </dev/null >>"$log" 2>&1 &
    fi
    SQS_PID=$!
    wait_for "$TIMEOUT" sqs_started || true
    if ! sqs_up; then
        echo "sqs: fauxqs did not open port $SQS_PORT, see $log" >&2
        return 1
    fi
}

# Done once the port is open or the started process has exited.
sqs_started() { sqs_up || ! kill -0 "$SQS_PID" 2>/dev/null; }

ensure_sqs() {
    if sqs_up; then
        echo "sqs: running at $HOST:$SQS_PORT"
    elif have fauxqs; then
        sqs_start_local || { echo "sqs: failed to start fauxqs"; return 1; }
        echo "sqs: started fauxqs"
    elif have npm; then
        npm install -g --no-fund --no-audit "fauxqs@$FAUXQS_VERSION" >&2 ||
            { echo "sqs: npm install -g fauxqs@$FAUXQS_VERSION failed"; return 1; }
        sqs_start_local || { echo "sqs: installed fauxqs but failed to start it"; return 1; }
        echo "sqs: installed and started fauxqs@$FAUXQS_VERSION"
    elif compose_up sqs; then
        wait_for "$TIMEOUT" sqs_up || { echo "sqs: docker compose container not ready"; return 1; }
        echo "sqs: started with docker compose"
    else
        echo "sqs: not running and neither fauxqs nor npm (Node.js >= 20) is installed (or run: docker compose up -d sqs)"
        return 1
    fi
}

# -------------------------------------------------------------------- nats

nats_up() { tcp_open "$HOST" "$NATS_PORT"; }

nats_bin() {
    if have nats-server; then
        command -v nats-server
    elif [ -x /usr/sbin/nats-server ]; then
        echo /usr/sbin/nats-server
    else
        return 1
    fi
}

nats_start_local() {
    local bin store=/var/lib/nats-server log=/var/log/nats-server.log pid=/run/nats-server-$NATS_PORT.pid
    bin=$(nats_bin) || return 1
    if ! is_root; then
        store="$LOG_DIR/nats-server-store" log="$LOG_DIR/nats-server.log" pid="$LOG_DIR/nats-server-$NATS_PORT.pid"
    fi
    mkdir -p "$store"
    if have start-stop-daemon; then
        # The pid file: any other nats-server (a test's private one on
        # another port) is not this one, and must not count as running.
        start-stop-daemon --start --oknodo --background --make-pidfile --pidfile "$pid" --exec "$bin" -- \
            -a "$HOST" -p "$NATS_PORT" -js -sd "$store" -l "$log" >&2
    else
        nohup "$bin" -a "$HOST" -p "$NATS_PORT" -js -sd "$store" -l "$log" </dev/null >/dev/null 2>&1 &
    fi
}

ensure_nats() {
    if nats_up; then
        echo "nats: running at $HOST:$NATS_PORT"
    elif nats_bin >/dev/null; then
        if ! { nats_start_local && wait_for "$TIMEOUT" nats_up; }; then
            echo "nats: failed to start"
            return 1
        fi
        echo "nats: started with JetStream"
    elif compose_up nats; then
        wait_for "$TIMEOUT" nats_up || { echo "nats: docker compose container not ready"; return 1; }
        echo "nats: started with docker compose"
    elif apt_install nats-server; then
        wait_for 5 nats_up || nats_start_local
        wait_for "$TIMEOUT" nats_up || { echo "nats: installed but failed to start"; return 1; }
        echo "nats: installed and started with JetStream"
    else
        echo "nats: not running and not installed (install nats-server, or run: docker compose up -d nats)"
        return 1
    fi
}

# -------------------------------------------------------------- prometheus

# Installs the package without letting its postinst start the system
# service: a policy-rc.d that answers 101 ("action forbidden") while
# apt-get runs, unless the machine has one of its own already.
POLICY_RC=/usr/sbin/policy-rc.d
prometheus_install() {
    local created=no rc=0
    is_root && have apt-get || return 1
    if [ ! -e "$POLICY_RC" ]; then
        # Removed again even if the script is interrupted meanwhile.
        trap 'rm -f "$POLICY_RC"' EXIT
        printf '#!/bin/sh\n# scripts/services.sh: no service starts while it installs prometheus\nexit 101\n' >"$POLICY_RC" &&
            chmod 755 "$POLICY_RC" && created=yes
    fi
    apt_install prometheus || rc=$?
    if [ "$created" = yes ]; then
        rm -f "$POLICY_RC"
        trap - EXIT
    fi
    [ "$rc" -eq 0 ] || return "$rc"
    # The package enables its unit: on a machine booted with systemd it
    # would start at the next boot.
    if have systemctl && [ -d /run/systemd/system ]; then
        systemctl disable --now prometheus >/dev/null 2>&1 || true
    fi
}

ensure_prometheus() {
    if have prometheus; then
        echo "prometheus: installed at $(command -v prometheus) (the tests start their own server)"
    elif prometheus_install && have prometheus; then
        echo "prometheus: installed, not started (the tests start their own server)"
    else
        echo "prometheus: not installed (install the prometheus package; the tests start their own server)"
        return 1
    fi
}

# -------------------------------------------------------------------- kcat

ensure_kcat() {
    if have kcat; then
        echo "kcat: installed at $(command -v kcat)"
    elif apt_install kcat && have kcat; then
        echo "kcat: installed"
    else
        echo "kcat: not installed (install the kcat package)"
        return 1
    fi
}

# ---------------------------------------------------------------- chromium

ensure_chromium() {
    if have chromium; then
        echo "chromium: installed at $(command -v chromium)"
    elif apt_install chromium && have chromium; then
        echo "chromium: installed"
    else
        echo "chromium: not installed (install the chromium package)"
        return 1
    fi
}

# -------------------------------------------------------------------- main

if [ $# -eq 0 ]; then
    set -- postgres mariadb redis rabbitmq sqs nats prometheus kcat chromium
fi
for svc in "$@"; do
    case "$svc" in
    postgres | mariadb | redis | rabbitmq | sqs | nats | prometheus | kcat | chromium) ;;
    *)
        echo "unknown service: $svc (known: postgres mariadb redis rabbitmq sqs nats prometheus kcat chromium)" >&2
        exit 2
        ;;
    esac
done

failed=()
for svc in "$@"; do
    "ensure_$svc" || failed+=("$svc")
done

if [ ${#failed[@]} -gt 0 ]; then
    echo "error: not reachable: ${failed[*]}" >&2
    if [ -n "${CI:-}" ]; then
        exit 1
    fi
    echo "warning: continuing; tests that need ${failed[*]} will be skipped" >&2
fi
