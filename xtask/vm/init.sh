#!/bin/busybox sh
# /init of the vm-test guest (a busybox initramfs built by `cargo xtask vm-test`): mounts what
# the agent needs, loads the kernel's WireGuard and TC modules, runs the conformance script,
# prints the verdict the host parses, and powers off.
/bin/busybox --install -s /bin
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
export LD_LIBRARY_PATH=/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t bpf bpf /sys/fs/bpf
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
mkdir -p /run/netns /dev/pts
/usr/bin/ip link set lo up
for module in wireguard veth dummy sch_ingress cls_bpf; do
    # Built-in on some kernels: modprobe then finds nothing to load, which is fine.
    modprobe "$module" 2>/dev/null || true
done
echo "VMTEST boot uptime=$(cut -d' ' -f1 /proc/uptime)"
if sh /conformance.sh; then
    echo "VMTEST RESULT PASS"
else
    echo "VMTEST RESULT FAIL"
fi
sync
poweroff -f
