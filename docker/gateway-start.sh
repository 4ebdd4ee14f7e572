#!/bin/sh
# The gateway container's start: render Nginx from the kvgate config mounted at $GATEWAY_CONFIG (the
# sidecar container mounts and reads the very same file), then run OpenResty on what was rendered.
# Rendering at every start, never at image build time, keeps one config for both halves: API keys,
# limits and every gateway setting in the ConfigMap reach Nginx too, and a changed ConfigMap reaches
# it with the next start. (Nginx and the sidecar still compare fingerprints of the config: a stale
# render is shown, and where keys or limits differ Nginx refuses requests.)
set -eu
: "${GATEWAY_CONFIG:=/etc/kvgate/kvgate.yaml}"
: "${GATEWAY_RUN_DIR:=/var/run/kvgate}"       # writable (an emptyDir under a read-only root)
: "${GATEWAY_LUA_DIR:=/opt/kvgate/lua}"
: "${GATEWAY_LISTEN:=0.0.0.0:8080}"
: "${GATEWAY_NGINX:=openresty}"
: "${GATEWAY_RENDER_FLAGS=--openresty}"       # OpenResty has the Lua module built in
if [ ! -r "$GATEWAY_CONFIG" ]; then
    echo "kvgate gateway: no config at $GATEWAY_CONFIG: mount the sidecar's kvgate.yaml there" >&2
    exit 2
fi
mkdir -p "$GATEWAY_RUN_DIR/nginx-tmp/body" "$GATEWAY_RUN_DIR/nginx-tmp/proxy" \
    "$GATEWAY_RUN_DIR/nginx-tmp/fastcgi" "$GATEWAY_RUN_DIR/nginx-tmp/uwsgi" "$GATEWAY_RUN_DIR/nginx-tmp/scgi"
# shellcheck disable=SC2086  # the flags are words
kvgate render-nginx --config "$GATEWAY_CONFIG" --out "$GATEWAY_RUN_DIR/nginx" --listen "$GATEWAY_LISTEN" \
    --run-dir "$GATEWAY_RUN_DIR" --lua-dir "$GATEWAY_LUA_DIR" --error-log /dev/stderr $GATEWAY_RENDER_FLAGS
exec "$GATEWAY_NGINX" -p "$GATEWAY_RUN_DIR" -c "$GATEWAY_RUN_DIR/nginx/nginx.conf" -e /dev/stderr
