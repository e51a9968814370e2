#!/bin/bash
# Idempotent: builds the real kube-apiserver v1.20.2 from Debian bookworm's `kubernetes` source
# package, for the Kubernetes source's integration tests (tests/src/kube.rs). No registry ships a
# kube-apiserver here and the Go module proxy is unreachable; the source package vendors every Go
# dependency. About 4 minutes and 1.5 GB of build cache (removed) the first time; a check of the
# installed binary's version afterwards. `cargo xtask kube-apiserver` runs it (`cargo xtask test` too).
set -euo pipefail
PREFIX=${PREFIX:-/opt/k8s-test}
BIN=$PREFIX/bin/kube-apiserver
if [ -x "$BIN" ] && "$BIN" --version 2>/dev/null | grep -q 'v1\.20\.2'; then echo "already have $BIN"; exit 0; fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends golang-go golang-github-modern-go-reflect2-dev etcd-server rsync jq >/dev/null
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
mkdir -p "$W/lists/partial" "$W/cache/archives/partial" "$W/parts"
# the archive this machine already uses for its binary packages
URIS=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources)
cat > "$W/parts/src.sources" <<EOF
Types: deb-src
URIs: $URIS
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
O=(-o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts="$W/parts" -o Dir::State::Lists="$W/lists" -o Dir::Cache="$W/cache")
apt-get "${O[@]}" update -qq
(cd "$W" && apt-get "${O[@]}" source --download-only kubernetes 2>&1 | grep -v unsandboxed)
tar xzf "$W"/kubernetes_*.orig.tar.gz -C "$W"
S=$(ls -d "$W"/kubernetes-1.20.*/ | head -1)
# vendored reflect2 v1.0.1 crashes (fatal error: fault in mapiterinit) under Go >= 1.18: use Debian's 1.0.2
rm -rf "$S/vendor/github.com/modern-go/reflect2"
cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 "$S/vendor/github.com/modern-go/reflect2"
rm -f "$S/vendor/github.com/modern-go/reflect2/go.mod"
printf "KUBE_GIT_TREE_STATE='clean'\nKUBE_GIT_VERSION='v1.20.2'\nKUBE_GIT_MAJOR='1'\nKUBE_GIT_MINOR='20'\n" > "$W/version.env"
(cd "$S" && env HOME="$W" GOPROXY=off GOFLAGS= CGO_ENABLED=0 KUBE_GIT_VERSION_FILE="$W/version.env" make WHAT=cmd/kube-apiserver >"$W/build.log" 2>&1) || { tail -30 "$W/build.log"; exit 1; }
install -D -m755 "$S/_output/bin/kube-apiserver" "$BIN"
"$BIN" --version
