#!/bin/sh
# The conformance subset `cargo xtask vm-test` runs inside the guest, on the booted kernel:
# a gateway namespace with a kernel WireGuard interface (wg0) and the agent, two peer
# namespaces with kernel WireGuard over veth, destinations on a dummy interface of the gateway.
#
# Prints one line per check, which the host parses into the table of docs/operations.md:
#   VMTEST check=NAME result=pass|fail ms=N detail=FREE TEXT TO THE END OF THE LINE
# and exits non-zero if any check failed.
set -u

AGENT_LOG=/tmp/agent.log
STATE_DIR=/etc/wgfence
STATE=$STATE_DIR/state.json
FAILED=0
AGENT_PID=
# The hook the agent is told to use (`--attach`), from the kernel command line
# (`wgfence.attach=tc`); the agent's default (auto) otherwise.
ATTACH=$(sed -n 's/.*wgfence\.attach=\([a-z]*\).*/\1/p' /proc/cmdline)
# The differential test's rounds (generated states; each loads the program anew, which costs
# most of its time under emulation), from `wgfence.diff_rounds=N`; the test's default otherwise.
DIFF_ROUNDS=$(sed -n 's/.*wgfence\.diff_rounds=\([0-9]*\).*/\1/p' /proc/cmdline)

# Debian's busybox runs its own applets before anything in PATH (also through nsenter and
# timeout): the full iproute2, iputils and coreutils programs are called by their paths.
ip() { /usr/bin/ip "$@"; }
ping() { /usr/bin/ping "$@"; }
tc() { /usr/bin/tc "$@"; }
in_ns() {
    ns=$1
    shift
    case $1 in ip | ping | tc | date)
        cmd=/usr/bin/$1
        shift
        set -- "$cmd" "$@"
        ;;
    esac
    nsenter --net=/run/netns/"$ns" "$@"
}
now_ms() { /usr/bin/date +%s%3N; }
result() { # NAME pass|fail MS DETAIL...
    name=$1 verdict=$2 ms=$3; shift 3
    [ "$verdict" = pass ] || FAILED=1
    echo "VMTEST check=$name result=$verdict ms=$ms detail=$*"
}
# A reply within 5 s (the first probe also waits for the WireGuard handshake).
reaches() { in_ns "$1" ping -c 1 -W 5 "$2" >/dev/null 2>&1; }
# No reply to 3 probes. Only meaningful once `reaches` has shown the tunnel is up.
blocked() { ! in_ns "$1" ping -c 3 -i 0.2 -W 1 "$2" >/dev/null 2>&1; }

# A 10 ms ping with timestamps (-D) in the background: NS DST COUNT FILE; sets $ping_pid.
ping_in_background() {
    in_ns "$1" ping -D -i 0.01 -c "$3" -W 1 "$2" >"$4" 2>&1 &
    ping_pid=$!
}
# The time in ms of the first (head) or last (tail) reply in a ping -D output: FILE head|tail.
# Lines read "[1796087398.123456] 64 bytes from ...".
reply_ms() {
    grep 'bytes from' "$1" | "$2" -n 1 | sed 's/^\[\([0-9]*\)\.\([0-9][0-9][0-9]\).*/\1\2/'
}

write_state() { # writes the state file atomically (rename), as an operator's tooling would
    cat > "$STATE.tmp"
    mv "$STATE.tmp" "$STATE"
}

start_agent() {
    # Not through in_ns: $! must be the agent itself (nsenter execs it), not a subshell.
    nsenter --net=/run/netns/gw wgfence --log wgfence=debug run --interface wg0 --state "$STATE" --no-metrics \
        ${ATTACH:+--attach "$ATTACH"} >>"$AGENT_LOG" 2>&1 &
    AGENT_PID=$!
}
agent_ready() { # waits until `wgfence status` reports this agent ($AGENT_PID) ready, 60 s
    i=0
    while [ $i -lt 600 ]; do
        if in_ns gw wgfence status --interface wg0 2>/dev/null |
            grep -q "^agent *pid $AGENT_PID, ready"; then
            return 0
        fi
        kill -0 "$AGENT_PID" 2>/dev/null || return 1
        sleep 0.1
        i=$((i + 1))
    done
    return 1
}
# The agent's pid as `status` reports it.
agent_pid() {
    in_ns gw wgfence status --interface wg0 2>/dev/null | sed -n 's/^agent *pid \([0-9]*\).*/\1/p'
}
# The "last reconcile" line of `status`: how many WireGuard peer updates the agent made.
last_wg_updates() {
    in_ns gw wgfence status --interface wg0 2>/dev/null |
        sed -n 's/^last reconcile.*, \([0-9]*\) WireGuard peer updates.*/\1/p'
}

# --- the differential test: the datapath as this kernel's verifier loaded it, against the
# reference model, under BPF_PROG_TEST_RUN (fewer packets than on the host: emulation) --------
run_differential() {
    t0=$(now_ms)
    WGFENCE_DIFF_PACKETS=12000 WGFENCE_DIFF_ROUNDS=${DIFF_ROUNDS:-12} \
        differential --test-threads=1 --nocapture --exact \
        both_variants_decide_like_the_reference_model >/tmp/differential.out 2>&1
    diff_rc=$?
    summary=$(sed -n 's/.*differential (\([a-z0-9]*\) variant): seed [0-9]*, \([0-9]* packets\) in.*/\1 \2/p' \
        /tmp/differential.out | tr '\n' ' ')
    if [ $diff_rc = 0 ] && [ -n "$summary" ]; then
        result differential pass $(($(now_ms) - t0)) "$summary, 0 mismatches"
    else
        tail -n 30 /tmp/differential.out
        why=$(grep -m 1 -o 'verifier\|disagree\|loading the datapath: [^.]*' /tmp/differential.out)
        result differential fail $(($(now_ms) - t0)) "${why:-rc=$diff_rc}"
    fi
}

# --- topology -----------------------------------------------------------------------------
ip netns add gw
ip -n gw link set lo up
ip -n gw link add dst type dummy
ip -n gw link set dst up
for a in 10.99.0.1/32 10.99.0.2/32; do ip -n gw addr add "$a" dev dst; done
for a in fd99::1/128 fd99::2/128; do ip -n gw addr add "$a" dev dst nodad; done

GW_KEY=$(wg genkey)
GW_PUB=$(echo "$GW_KEY" | wg pubkey)
ip -n gw link add wg0 type wireguard
echo "$GW_KEY" > /tmp/gw.key
in_ns gw wg set wg0 private-key /tmp/gw.key listen-port 51820
ip -n gw addr add 10.8.0.1/24 dev wg0
ip -n gw addr add fd00:8::1/64 dev wg0 nodad
ip -n gw link set wg0 up

n=1
for peer in a b; do
    ip netns add "$peer"
    ip -n "$peer" link set lo up
    ip link add "u$peer" netns gw type veth peer name uplink netns "$peer"
    ip -n gw addr add "192.168.$n.1/24" dev "u$peer"
    ip -n gw link set "u$peer" up
    ip -n "$peer" addr add "192.168.$n.2/24" dev uplink
    ip -n "$peer" link set uplink up
    key=$(wg genkey)
    echo "$key" > "/tmp/$peer.key"
    eval "PUB_$peer=\$(echo \"\$key\" | wg pubkey)"
    ip -n "$peer" link add wgp type wireguard
    in_ns "$peer" wg set wgp private-key "/tmp/$peer.key" listen-port 51821 \
        peer "$GW_PUB" endpoint "192.168.$n.1:51820" allowed-ips 0.0.0.0/0,::/0
    ip -n "$peer" addr add "10.8.0.$((n + 1))/32" dev wgp
    ip -n "$peer" addr add "fd00:8::$((n + 1))/128" dev wgp nodad
    ip -n "$peer" link set wgp up
    ip -n "$peer" route add 10.99.0.0/24 dev wgp
    ip -n "$peer" route add 10.8.0.0/24 dev wgp
    ip -n "$peer" -6 route add fd99::/64 dev wgp
    n=$((n + 1))
done
# shellcheck disable=SC2154 # set by eval above
PA=$PUB_a PB=$PUB_b
# b once restricted: 10.99.0.1 and fd99::1, with an IPv6 address.
B_RESTRICTED='{"name": "b", "publicKey": "'"$PB"'", "address": "10.8.0.3", "addressV6": "fd00:8::3",
   "endpoint": "192.168.2.2:51821",
   "egress": [{"cidr": "10.99.0.1/32", "protocol": "any"}, {"cidr": "fd99::1/128", "protocol": "any"}]}'
mkdir -p "$STATE_DIR"
chmod 755 "$STATE_DIR"

# a: may reach 10.99.0.1 and fd99::1 only. b: unrestricted.
write_state <<EOF
{"version": 1, "peers": [
  {"name": "a", "publicKey": "$PA", "address": "10.8.0.2", "addressV6": "fd00:8::2",
   "endpoint": "192.168.1.2:51821",
   "egress": [{"cidr": "10.99.0.1/32", "protocol": "any"}, {"cidr": "fd99::1/128", "protocol": "any"}]},
  {"name": "b", "publicKey": "$PB", "address": "10.8.0.3", "endpoint": "192.168.2.2:51821"}
]}
EOF

# --- the agent on kernel WireGuard ---------------------------------------------------------
t0=$(now_ms)
start_agent
if agent_ready; then
    result start pass $(($(now_ms) - t0)) agent_ready
else
    # The reason, for the table: the agent's error, or the verifier's last complaint.
    why=$(sed -n 's/.*program \([a-z_0-9]*\): the BPF_PROG_LOAD.*/verifier rejects \1/p' "$AGENT_LOG" | head -n 1)
    complaint=$(grep -B1 '^verification time' "$AGENT_LOG" | head -n 1)
    [ -n "$why" ] || why=$(grep -m 1 '^error' "$AGENT_LOG" | cut -c 1-100)
    result start fail $(($(now_ms) - t0)) "$why: $complaint"
    cat "$AGENT_LOG"
    run_differential
    exit 1
fi
backend=$(sed -n 's/.*wireguard_backend="*\([a-z]*\).*/\1/p' "$AGENT_LOG" | head -n 1)
status=$(in_ns gw wgfence status --interface wg0 2>&1)
echo "$status"
hook=$(echo "$status" | sed -n 's/^hook  *\([a-z]*\).*/\1/p' | head -n 1)
case "$hook" in
    tc) hook="tc (clsact)" ;;
    "") hook=unknown ;;
esac
# Whether this kernel put the policy tries into their array of maps in one batch.
tries_batch=yes
grep -q 'no batch update for an array of maps' "$AGENT_LOG" && tries_batch=no
echo "VMTEST info kernel=$(uname -r) backend=${backend:-unknown} attach=${ATTACH:-auto} tries_batch=$tries_batch hook=$hook"

# The agent added both peers to wg0 through netlink, with their addresses as allowed IPs.
peers=$(in_ns gw wg show wg0 allowed-ips)
echo "$peers"
if echo "$peers" | grep -q "^$PA	.*10.8.0.2/32" && echo "$peers" | grep -q "fd00:8::2/128" &&
    echo "$peers" | grep -q "^$PB	10.8.0.3/32"; then
    result wg_add pass 0 "backend=$backend"
else
    result wg_add fail 0 "backend=$backend"
fi

# --- enforcement ---------------------------------------------------------------------------
t0=$(now_ms)
if reaches a 10.99.0.1 && blocked a 10.99.0.2 && reaches b 10.99.0.2; then
    result enforce_v4 pass $(($(now_ms) - t0)) a_to_allowed_passes_a_to_other_dropped
else
    result enforce_v4 fail $(($(now_ms) - t0)) a_to_allowed_passes_a_to_other_dropped
fi
t0=$(now_ms)
if reaches a fd99::1 && blocked a fd99::2; then
    result enforce_v6 pass $(($(now_ms) - t0)) a_to_allowed_passes_a_to_other_dropped
else
    result enforce_v6 fail $(($(now_ms) - t0)) a_to_allowed_passes_a_to_other_dropped
fi

# --- a policy change: a flips to .2, gains a keepalive (a peer update); b becomes restricted
# and gains an IPv6 address (an allowed IP added to a live peer). Timed under a 10 ms ping to
# the newly allowed destination: from the write to the first reply. ----------------------
ping_in_background a 10.99.0.2 300 /tmp/change.ping
sleep 0.5
t0=$(now_ms)
write_state <<EOF
{"version": 1, "peers": [
  {"name": "a", "publicKey": "$PA", "address": "10.8.0.2", "addressV6": "fd00:8::2",
   "endpoint": "192.168.1.2:51821", "persistentKeepalive": 25,
   "egress": [{"cidr": "10.99.0.2/32", "protocol": "any"}, {"cidr": "fd99::2/128", "protocol": "any"}]},
  $B_RESTRICTED
]}
EOF
wait "$ping_pid"
first=$(reply_ms /tmp/change.ping head)
applied=$((${first:-0} - t0))
[ $applied -lt 0 ] && applied=0
if [ -n "$first" ] && reaches a 10.99.0.2 && blocked a 10.99.0.1 && reaches a fd99::2 && blocked a fd99::1 &&
    reaches b 10.99.0.1 && blocked b 10.99.0.2; then
    result policy_change pass $applied first_probe_through_after_write
else
    result policy_change fail $applied first_probe_through_after_write
fi
keepalive=$(in_ns gw wg show wg0 persistent-keepalive | grep "^$PA" | cut -f2)
ips_b=$(in_ns gw wg show wg0 allowed-ips | grep "^$PB" | cut -f2)
if [ "$keepalive" = 25 ] && echo "$ips_b" | grep -q 'fd00:8::3/128' &&
    echo "$ips_b" | grep -q '10.8.0.3/32' && reaches b fd99::1; then
    result wg_update pass 0 "keepalive=$keepalive b=$ips_b"
else
    result wg_update fail 0 "keepalive=$keepalive b=$ips_b"
fi

# --- SIGKILL and restart under a 10 ms ping: zero loss; the restarted agent adopts wg0's
# peers as they are (0 WireGuard updates) ----------------------------------------------------
in_ns b ping -i 0.01 -c 800 -W 2 10.99.0.1 >/tmp/restart.ping 2>&1 &
ping_pid=$!
sleep 2
old_pid=$(agent_pid)
t0=$(now_ms)
kill -KILL "$old_pid"
wait "$AGENT_PID" 2>/dev/null
start_agent
agent_ready
restarted=$(($(now_ms) - t0))
new_pid=$(agent_pid)
wait "$ping_pid"
stats=$(grep 'packets transmitted' /tmp/restart.ping)
sent=$(echo "$stats" | cut -d' ' -f1)
got=$(echo "$stats" | cut -d' ' -f4)
if [ -n "$sent" ] && [ "$sent" = "$got" ] && [ -n "$new_pid" ] && [ "$new_pid" != "$old_pid" ]; then
    result restart pass $restarted "sent=$sent received=$got"
else
    result restart fail $restarted "sent=$sent received=$got pid=$old_pid->$new_pid"
fi
updates=$(last_wg_updates)
if [ "$updates" = 0 ] && blocked b 10.99.0.2; then
    result wg_adopt pass 0 "wireguard_updates_after_restart=$updates"
else
    result wg_adopt fail 0 "wireguard_updates_after_restart=$updates"
fi

# --- wgfence status ------------------------------------------------------------------------
status=$(in_ns gw wgfence status --interface wg0 2>&1)
if echo "$status" | grep -q '^datapath *attached' && [ "$hook" != unknown ] &&
    echo "$status" | grep -q '^a  '; then
    result status pass 0 "$hook"
else
    echo "$status"
    result status fail 0 "hook=$hook"
fi

# --- the drop monitor: one event for a denied packet ---------------------------------------
in_ns gw timeout 30 wgfence monitor --interface wg0 --count 1 >/tmp/monitor.out 2>&1 &
mon_pid=$!
sleep 1
t0=$(now_ms)
i=0
while kill -0 "$mon_pid" 2>/dev/null && [ $i -lt 20 ]; do
    in_ns b ping -c 1 -W 1 10.99.0.2 >/dev/null 2>&1
    i=$((i + 1))
done
wait "$mon_pid"
mon_rc=$?
if [ $mon_rc = 0 ] && grep -q '10.99.0.2' /tmp/monitor.out; then
    result monitor pass $(($(now_ms) - t0)) "$(head -n 1 /tmp/monitor.out)"
else
    cat /tmp/monitor.out
    result monitor fail $(($(now_ms) - t0)) "rc=$mon_rc"
fi

# --- per-packet cost: the agent's ingress program (peers and policies in its maps) against an
# empty program, both under BPF_PROG_TEST_RUN in this guest; raw IPv4 ICMP echo packets, as
# the program sees them on wg0 (no link-layer header). ---------------------------------
ipv4_echo() { # FILE SRC_OCTETS DST_OCTETS, octets as octal escapes
    printf "\105\000\000\034\000\000\000\000\100\001\000\000$2$3\010\000\367\377\000\000\000\000" >"$1"
}
ipv4_echo /tmp/allowed.pkt '\012\010\000\002' '\012\143\000\002'  # a -> 10.99.0.2 (allowed)
ipv4_echo /tmp/denied.pkt '\012\010\000\002' '\012\143\000\001'   # a -> 10.99.0.1 (denied)
ipv4_echo /tmp/unknown.pkt '\012\010\000\011' '\012\143\000\001'  # 10.8.0.9: no peer
ns_per_run() { # PROGRAM-SPEC... FILE: the average duration of 50,000 runs, in ns
    file=$1
    shift
    bpftool prog run "$@" data_in "$file" repeat 50000 2>/dev/null |
        sed -n 's/.*duration (average): \([0-9]*\)ns.*/\1/p'
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.1f", a / b; else print "?" }'; }
prog=$(in_ns gw wgfence status --interface wg0 2>/dev/null | sed -n \
    -e 's/^link .*program id \([0-9]*\).*/\1/p' -e 's/^ingress filter .*program id \([0-9]*\).*/\1/p')
if bpftool prog load /empty.o /sys/fs/bpf/vmtest_empty type classifier 2>/dev/null && [ -n "$prog" ]; then
    empty=$(ns_per_run /tmp/unknown.pkt pinned /sys/fs/bpf/vmtest_empty)
    unknown=$(ns_per_run /tmp/unknown.pkt id "$prog")
    allowed=$(ns_per_run /tmp/allowed.pkt id "$prog")
    denied=$(ns_per_run /tmp/denied.pkt id "$prog")
    rm -f /sys/fs/bpf/vmtest_empty
    if [ -n "$empty" ] && [ -n "$unknown" ] && [ -n "$allowed" ] && [ -n "$denied" ]; then
        result cost pass 0 "unknown source $(ratio "$unknown" "$empty")x, allowed $(ratio "$allowed" "$empty")x, denied $(ratio "$denied" "$empty")x (empty: $empty ns)"
    else
        result cost fail 0 "empty=$empty unknown=$unknown allowed=$allowed denied=$denied"
    fi
else
    result cost fail 0 "no program to measure (id '$prog') or the empty program did not load"
fi

# --- revocation, timed: a under a 10 ms ping to its allowed destination; the state drops a;
# the time from the write to the first probe without a reply -------------------------------
ping_in_background a 10.99.0.2 400 /tmp/revoke.ping
sleep 1.5
t_write=$(now_ms)
write_state <<EOF
{"version": 1, "peers": [
  $B_RESTRICTED
]}
EOF
wait "$ping_pid"
last=$(reply_ms /tmp/revoke.ping tail)
revoke_ms=$((last - t_write))
[ $revoke_ms -lt 0 ] && revoke_ms=0
gone=$(in_ns gw wg show wg0 peers | grep -c "^$PA" || true)
if [ -n "$last" ] && [ "$gone" = 0 ] && ! reaches a 10.99.0.2 && reaches b 10.99.0.1; then
    result revocation pass $revoke_ms "last_reply_after_write=${revoke_ms}ms peer_removed"
else
    result revocation fail $revoke_ms "last=$last gone=$gone"
fi

# --- detach: the programs leave the interface (a denied destination passes again), the
# pins are gone, and so are the programs themselves (nothing holds them any more) ----------
programs=$(in_ns gw wgfence status --interface wg0 2>/dev/null | sed -n 's/.*program id \([0-9]*\).*/\1/p')
kill -TERM "$AGENT_PID"
wait "$AGENT_PID" 2>/dev/null
t0=$(now_ms)
if in_ns gw wgfence detach --interface wg0; then
    detached=$(($(now_ms) - t0))
    filters=$(in_ns gw tc filter show dev wg0 ingress 2>/dev/null)
    # The kernel frees a program after an RCU grace period: allow it 2 s.
    left=$programs
    i=0
    while [ -n "$left" ] && [ $i -lt 20 ]; do
        sleep 0.1
        left=$(for id in $programs; do bpftool prog show id "$id" >/dev/null 2>&1 && echo "$id"; done)
        i=$((i + 1))
    done
    if [ ! -e /sys/fs/bpf/wgfence/wg0 ] && [ -z "$filters" ] && [ -n "$programs" ] &&
        [ -z "$left" ] && reaches b 10.99.0.2; then
        result detach pass $detached "pins, filters and programs $(echo $programs) gone; traffic unfiltered"
    else
        result detach fail $detached "filters=$filters programs=$(echo $programs) left=$(echo $left)"
    fi
else
    result detach fail $(($(now_ms) - t0)) detach_failed
fi

run_differential

if [ $FAILED != 0 ]; then
    echo "--- agent log (last 40 lines)"
    tail -n 40 "$AGENT_LOG"
fi
exit $FAILED
