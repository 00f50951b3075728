#!/bin/sh
# Install herd on this host: a venv under /opt/herd, /etc/herd/agent.toml from the
# commented reference, tokens (0600) generated once or copied from a directory, and the
# systemd units enabled and started.
#
#   sudo systemd/install.sh [--tokens DIR] [--placer] [--no-start] [--prefix /opt/herd] [--source DIR]
#
#   --tokens DIR   copy placer/cluster/operator/viewer/metrics .token from DIR (the same set on
#                  every host of a cluster); without it a set is generated once and kept.
#   --placer       also install and enable herd-placer.service on this host.
#   --no-start     install and enable, but do not start (for images).
set -eu

PREFIX=/opt/herd
ETC=/etc/herd
TOKENS_FROM=""
PLACER=0
START=1
SRC=$(cd "$(dirname "$0")/.." && pwd)
UNIT_DIR=/etc/systemd/system

while [ $# -gt 0 ]; do
    case "$1" in
        --tokens) TOKENS_FROM=$2; shift 2 ;;
        --placer) PLACER=1; shift ;;
        --no-start) START=0; shift ;;
        --prefix) PREFIX=$2; shift 2 ;;
        --source) SRC=$2; shift 2 ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown option $1" >&2; exit 2 ;;
    esac
done

[ "$(id -u)" = 0 ] || { echo "install.sh: run as root" >&2; exit 1; }
command -v python3 >/dev/null || { echo "install.sh: python3 (>= 3.11) is required" >&2; exit 1; }

echo "herd: installing from $SRC into $PREFIX"
mkdir -p "$PREFIX"
[ -x "$PREFIX/venv/bin/python" ] || python3 -m venv "$PREFIX/venv"
"$PREFIX/venv/bin/pip" install -q --upgrade pip
"$PREFIX/venv/bin/pip" install -q "$SRC"
mkdir -p "$PREFIX/share" && cp "$SRC/systemd/agent.toml" "$PREFIX/share/agent.toml.reference"

mkdir -p "$ETC"
chmod 0755 "$ETC"
if [ ! -e "$ETC/agent.toml" ]; then
    install -m 0644 "$SRC/systemd/agent.toml" "$ETC/agent.toml"
    echo "herd: wrote $ETC/agent.toml (edit node topology and listen addresses)"
else
    echo "herd: keeping existing $ETC/agent.toml"
fi

# The unprivileged user workloads run as ([workloads] user in agent.toml): no login, no home.
if ! id herd-workload >/dev/null 2>&1; then
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
    "$PREFIX/venv/bin/python" -c 'import sys; from scheduler_link.auth import generate_token_dir; generate_token_dir(sys.argv[1])' "$ETC/tokens"
    echo "herd: tokens in $ETC/tokens (copy this dir to every host of the cluster)"
fi
chown root:root "$ETC"/tokens/*.token
chmod 0600 "$ETC"/tokens/*.token

install -m 0644 "$SRC/systemd/herd-agent.service" "$UNIT_DIR/herd-agent.service"
UNITS="herd-agent.service"
if [ "$PLACER" = 1 ]; then
    install -m 0644 "$SRC/systemd/herd-placer.service" "$UNIT_DIR/herd-placer.service"
    if [ ! -e "$ETC/placer.toml" ]; then
        install -m 0644 "$SRC/systemd/placer.toml" "$ETC/placer.toml"
    fi
    UNITS="$UNITS herd-placer.service"
fi
systemctl daemon-reload
if [ "$START" = 1 ]; then
    systemctl enable --now $UNITS
    echo "herd: enabled and started $UNITS"
else
    systemctl enable $UNITS
    echo "herd: enabled $UNITS (not started: --no-start)"
fi
