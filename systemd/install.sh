#!/bin/sh
# Install, upgrade or remove herd on this host: a venv under PREFIX (/opt/herd), the commented
# reference configs in /etc/herd, tokens (0600) generated once or copied from a directory, the
# systemd units (paths rewritten to PREFIX) enabled and started.
#
#   sudo systemd/install.sh [--agent] [--placer] [--tokens DIR] [--tls DIR] [--no-start] [--prefix DIR] [--source DIR]
#   sudo systemd/install.sh --uninstall [--agent] [--placer] [--purge] [--prefix DIR]
#
#   --agent        install herd-agent.service (a GPU host).
#   --placer       install herd-placer.service (the placer host); with --agent too, both.
#                  Neither: what is installed already (an upgrade), else the agent.
#   --tokens DIR   copy placer/cluster/operator/viewer/metrics .token from DIR (the same set on
#                  every host of a cluster); without it a set is generated once and kept.
#   --tls DIR      copy this host's TLS material into /etc/herd/tls (0700; keys 0600): ca.crt and
#                  node.crt/node.key (`herd pki issue --node ID` wrote DIR/nodes/ID/) for an
#                  agent, placer.crt/placer.key (the `herd pki init` dir) for the placer. Without
#                  it a placer install makes a cluster CA once in /etc/herd/pki (kept) and takes
#                  its certificate from there (an agent on the same host gets one too); an
#                  agent-only install says what to copy. The units pass the files to the
#                  daemons as credentials (LoadCredential=; docs/security.md).
#   --no-start     install and enable, but do not start (for images). An upgrade still restarts
#                  the units that were running.
#   --prefix DIR   where the venv and the shared files go (default /opt/herd).
#   --uninstall    stop, disable and remove the units and PREFIX; configs, tokens and state
#                  stay unless --purge (which also removes the herd-workload user).
# Re-running upgrades in place: the package is reinstalled, units rewritten, configs and tokens
# kept, and the units that were running are restarted. Running it twice changes nothing more.
set -eu

PREFIX=/opt/herd
ETC=/etc/herd
TOKENS_FROM=""
TLS_FROM=""
AGENT=0
PLACER=0
START=1
UNINSTALL=0
PURGE=0
SRC=$(cd "$(dirname "$0")/.." && pwd)
UNIT_DIR=/etc/systemd/system
STATE_ROOT=/var/lib

while [ $# -gt 0 ]; do
    case "$1" in
        --tokens) TOKENS_FROM=$2; shift 2 ;;
        --tls) TLS_FROM=$2; shift 2 ;;
        --agent) AGENT=1; shift ;;
        --placer) PLACER=1; shift ;;
        --no-start) START=0; shift ;;
        --prefix) PREFIX=$2; shift 2 ;;
        --source) SRC=$2; shift 2 ;;
        --uninstall) UNINSTALL=1; shift ;;
        --purge) PURGE=1; shift ;;
        -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown option $1" >&2; exit 2 ;;
    esac
done

case "$PREFIX" in
    /*) PREFIX=${PREFIX%/} ;;
    *) echo "install.sh: --prefix must be an absolute path" >&2; exit 2 ;;
esac
[ "$PURGE" = 0 ] || [ "$UNINSTALL" = 1 ] || { echo "install.sh: --purge goes with --uninstall" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "install.sh: run as root" >&2; exit 1; }

installed() { [ -e "$UNIT_DIR/herd-$1.service" ]; }
active() { systemctl is-active --quiet "herd-$1.service" 2>/dev/null; }

# Neither --agent nor --placer: the roles already installed here (an upgrade or an uninstall
# of everything), else the agent.
if [ "$AGENT" = 0 ] && [ "$PLACER" = 0 ]; then
    installed agent && AGENT=1
    installed placer && PLACER=1
    if [ "$AGENT" = 0 ] && [ "$PLACER" = 0 ] && [ "$UNINSTALL" = 0 ]; then AGENT=1; fi
fi
ROLES=""
[ "$AGENT" = 1 ] && ROLES="agent"
[ "$PLACER" = 1 ] && ROLES="$ROLES placer"

# ------------------------------------------------------------------------- uninstall
if [ "$UNINSTALL" = 1 ]; then
    for role in $ROLES; do
        if installed "$role"; then
            systemctl disable --now "herd-$role.service" || true
            rm -f "$UNIT_DIR/herd-$role.service"
            echo "herd: removed herd-$role.service"
        fi
        if [ "$PURGE" = 1 ]; then
            rm -f "$ETC/$role.toml"
            if [ "$role" = agent ]; then
                rm -rf "$STATE_ROOT/herd"
                if id herd-workload >/dev/null 2>&1; then userdel herd-workload || true; fi
            else
                rm -rf "$STATE_ROOT/herd-placer" "$STATE_ROOT/private/herd-placer"
            fi
            echo "herd: purged the $role's configuration and state"
        fi
    done
    systemctl daemon-reload
    if ! installed agent && ! installed placer; then
        rm -rf "$PREFIX/venv" "$PREFIX/share"
        rmdir "$PREFIX" 2>/dev/null || true
        if [ "$PURGE" = 1 ]; then
            rm -rf "$ETC"
            echo "herd: removed $ETC (tokens included)"
        else
            echo "herd: kept $ETC (configuration and tokens) and the state; --purge removes them"
        fi
    fi
    exit 0
fi

# --------------------------------------------------------------------------- install
command -v python3 >/dev/null || { echo "install.sh: python3 (>= 3.11) is required" >&2; exit 1; }
WAS_ACTIVE=""
for role in $ROLES; do
    if active "$role"; then WAS_ACTIVE="$WAS_ACTIVE $role"; fi
done

echo "herd: installing ($ROLES ) from $SRC into $PREFIX"
mkdir -p "$PREFIX"
[ -x "$PREFIX/venv/bin/python" ] || python3 -m venv "$PREFIX/venv"
"$PREFIX/venv/bin/pip" install -q --upgrade pip
# --force-reinstall --no-deps on top: the same version number from a newer checkout is
# still an upgrade.
"$PREFIX/venv/bin/pip" install -q --upgrade "$SRC"
"$PREFIX/venv/bin/pip" install -q --force-reinstall --no-deps "$SRC"
mkdir -p "$PREFIX/share/doc/herd"
install -m 0644 "$SRC/README.md" "$PREFIX/share/doc/herd/README.md"
install -m 0644 "$SRC/systemd/agent.toml" "$PREFIX/share/agent.toml.reference"
install -m 0644 "$SRC/systemd/placer.toml" "$PREFIX/share/placer.toml.reference"

mkdir -p "$ETC"
chmod 0755 "$ETC"
for role in $ROLES; do
    if [ ! -e "$ETC/$role.toml" ]; then
        install -m 0644 "$SRC/systemd/$role.toml" "$ETC/$role.toml"
        echo "herd: wrote $ETC/$role.toml (edit it: see $PREFIX/share/$role.toml.reference)"
    else
        echo "herd: keeping existing $ETC/$role.toml"
    fi
done

# The unprivileged user workloads run as ([workloads] user in agent.toml): no login, no home.
if [ "$AGENT" = 1 ] && ! id herd-workload >/dev/null 2>&1; then
    NOLOGIN=$(command -v nologin || echo /usr/sbin/nologin)
    useradd --system --no-create-home --home-dir /nonexistent --shell "$NOLOGIN" \
        --user-group herd-workload
    echo "herd: created the system user herd-workload (workloads run as it)"
fi

mkdir -p "$ETC/tokens"
chown root:root "$ETC/tokens"
chmod 0700 "$ETC/tokens"
if [ -n "$TOKENS_FROM" ]; then
    for role in placer cluster operator; do
        [ -s "$TOKENS_FROM/$role.token" ] || { echo "install.sh: missing $TOKENS_FROM/$role.token" >&2; exit 1; }
        install -m 0600 "$TOKENS_FROM/$role.token" "$ETC/tokens/$role.token"
    done
    for role in viewer metrics; do  # newer roles: copied when the set has them
        if [ -s "$TOKENS_FROM/$role.token" ]; then
            install -m 0600 "$TOKENS_FROM/$role.token" "$ETC/tokens/$role.token"
        else
            echo "herd: $TOKENS_FROM has no $role.token: reads need the operator token until you add one" >&2
        fi
    done
    echo "herd: tokens copied from $TOKENS_FROM"
else
    # generated once: existing tokens are never overwritten
    "$PREFIX/venv/bin/python" -c 'import sys; from infra.auth import generate_token_dir; generate_token_dir(sys.argv[1])' "$ETC/tokens"
    echo "herd: tokens in $ETC/tokens (copy this dir to every host of the cluster)"
fi
chown root:root "$ETC"/tokens/*.token
chmod 0600 "$ETC"/tokens/*.token

# TLS material (docs/security.md): /etc/herd/tls holds what this host's daemons present.
mkdir -p "$ETC/tls"
chown root:root "$ETC/tls"
chmod 0700 "$ETC/tls"
if [ -n "$TLS_FROM" ]; then
    [ -s "$TLS_FROM/ca.crt" ] || { echo "install.sh: missing $TLS_FROM/ca.crt" >&2; exit 1; }
    install -m 0644 "$TLS_FROM/ca.crt" "$ETC/tls/ca.crt"
    for name in node placer; do
        if [ -s "$TLS_FROM/$name.crt" ] && [ -s "$TLS_FROM/$name.key" ]; then
            install -m 0644 "$TLS_FROM/$name.crt" "$ETC/tls/$name.crt"
            install -m 0600 "$TLS_FROM/$name.key" "$ETC/tls/$name.key"
        fi
    done
    # enrolment keys (docs/security.md): the node's beside node.key, the master for the placer
    [ -s "$TLS_FROM/node.enrol" ] && install -m 0600 "$TLS_FROM/node.enrol" "$ETC/tls/node.enrol"
    [ "$PLACER" = 1 ] && [ -s "$TLS_FROM/enrol.secret" ] && install -m 0600 "$TLS_FROM/enrol.secret" "$ETC/tls/enrol.secret"
    echo "herd: TLS material copied from $TLS_FROM"
elif [ "$PLACER" = 1 ]; then
    # a cluster CA made once and kept (its key stays in /etc/herd/pki, root's, 0700)
    if [ ! -e "$ETC/pki/ca.key" ]; then
        "$PREFIX/venv/bin/python" -c 'import sys; from infra.pki import init; init(sys.argv[1])' "$ETC/pki"
        echo "herd: made a cluster CA in $ETC/pki (issue node certificates: herd pki issue --node ID $ETC/pki)"
    fi
    install -m 0644 "$ETC/pki/ca.crt" "$ETC/tls/ca.crt"
    [ -s "$ETC/tls/placer.crt" ] || { install -m 0644 "$ETC/pki/placer.crt" "$ETC/tls/placer.crt"
                                      install -m 0600 "$ETC/pki/placer.key" "$ETC/tls/placer.key"; }
    [ -s "$ETC/pki/enrol.secret" ] && [ ! -s "$ETC/tls/enrol.secret" ] && \
        install -m 0600 "$ETC/pki/enrol.secret" "$ETC/tls/enrol.secret"
    if [ "$AGENT" = 1 ] && [ ! -s "$ETC/tls/node.crt" ]; then
        node=$(hostname)
        "$PREFIX/venv/bin/python" -c 'import sys; from infra.pki import issue_node; issue_node(sys.argv[1], sys.argv[2])' "$ETC/pki" "$node"
        install -m 0644 "$ETC/pki/nodes/$node/node.crt" "$ETC/tls/node.crt"
        install -m 0600 "$ETC/pki/nodes/$node/node.key" "$ETC/tls/node.key"
        install -m 0600 "$ETC/pki/nodes/$node/node.enrol" "$ETC/tls/node.enrol"
        echo "herd: issued node:$node a certificate for this host's agent"
    fi
elif [ ! -s "$ETC/tls/node.crt" ]; then
    echo "herd: no TLS material yet: copy ca.crt, node.crt, node.key (herd pki issue --node ID on the CA's host)" \
         "into $ETC/tls (or re-run with --tls DIR), or set tls_bootstrap_token / insecure = true in $ETC/agent.toml" >&2
fi

# Units name /opt/herd; rewrite it to PREFIX (ExecStart=, Documentation=).
for role in $ROLES; do
    sed "s|/opt/herd/|$PREFIX/|g" "$SRC/systemd/herd-$role.service" > "$UNIT_DIR/.herd-$role.service.new"
    chmod 0644 "$UNIT_DIR/.herd-$role.service.new"
    mv -f "$UNIT_DIR/.herd-$role.service.new" "$UNIT_DIR/herd-$role.service"
done
systemctl daemon-reload
for role in $ROLES; do
    unit="herd-$role.service"
    systemctl enable "$unit"
    # a unit stopped by its start limit or by RestartPreventExitStatus= gets a fresh start
    systemctl reset-failed "$unit" 2>/dev/null || true
    case " $WAS_ACTIVE " in
        *" $role "*) systemctl restart "$unit"; echo "herd: upgraded and restarted $unit" ;;
        *) if [ "$START" = 1 ]; then
               systemctl start "$unit"; echo "herd: enabled and started $unit"
           else
               echo "herd: enabled $unit (not started: --no-start)"
           fi ;;
    esac
done
