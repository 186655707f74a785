// gpushare-loopback: the CNI plugin of gpushare's local real nodes (devstack/cluster/realnode.py).
//
// The local nodes may not use addresses outside loopback, so a pod's network namespace gets nothing but its own
// `lo`. containerd's CRI still wants an IP for the sandbox (it reads the result's IPs and takes the first as the
// pod IP), so ADD brings `lo` up inside CNI_NETNS and answers with 127.0.0.1/8 on `lo`, with no interface index
// (an index would make containerd look for an `eth0`). DEL has nothing to undo; CHECK says whether `lo` is up;
// VERSION lists the spec versions it speaks. No bridge, no route, no iptables rule.
//
// The CNI protocol (environment CNI_COMMAND, CNI_NETNS, CNI_IFNAME; the network configuration on stdin; a JSON
// result or error on stdout) is the one in the containernetworking/cni SPEC.md. Only Go's standard library is used.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime"
	"syscall"
	"unsafe"
)

var supported = []string{"0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"}

type netConf struct {
	CNIVersion string `json:"cniVersion"`
	Name       string `json:"name"`
}

type cniError struct {
	CNIVersion string `json:"cniVersion"`
	Code       int    `json:"code"`
	Msg        string `json:"msg"`
	Details    string `json:"details,omitempty"`
}

// fail writes a CNI error result and exits non-zero, as the spec asks.
func fail(version string, code int, msg string, err error) {
	out := cniError{CNIVersion: version, Code: code, Msg: msg}
	if err != nil {
		out.Details = err.Error()
	}
	if out.CNIVersion == "" {
		out.CNIVersion = "1.0.0"
	}
	_ = json.NewEncoder(os.Stdout).Encode(out)
	os.Exit(1)
}

// ifreq is struct ifreq of <linux/if.h>: a 16-byte name and a union whose first member here is the flags.
type ifreq struct {
	name  [16]byte
	flags uint16
	_     [22]byte
}

// withNetns runs fn on this OS thread while it is inside the network namespace at path.
func withNetns(path string, fn func() error) error {
	runtime.LockOSThread() // the thread is left to die in the namespace: the process exits right after
	target, err := os.Open(path)
	if err != nil {
		return err
	}
	defer target.Close()
	if _, _, errno := syscall.RawSyscall(sysSetns, target.Fd(), syscall.CLONE_NEWNET, 0); errno != 0 {
		return fmt.Errorf("setns %s: %w", path, errno)
	}
	return fn()
}

// loFlags reads (and with set, first ORs in IFF_UP) the flags of `lo` in the current namespace.
func loFlags(set bool) (uint16, error) {
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_DGRAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer syscall.Close(fd)
	var req ifreq
	copy(req.name[:], "lo")
	if _, _, errno := syscall.Syscall(syscall.SYS_IOCTL, uintptr(fd), syscall.SIOCGIFFLAGS, uintptr(unsafe.Pointer(&req))); errno != 0 {
		return 0, fmt.Errorf("SIOCGIFFLAGS lo: %w", errno)
	}
	if set && req.flags&syscall.IFF_UP == 0 {
		req.flags |= syscall.IFF_UP
		if _, _, errno := syscall.Syscall(syscall.SYS_IOCTL, uintptr(fd), syscall.SIOCSIFFLAGS, uintptr(unsafe.Pointer(&req))); errno != 0 {
			return 0, fmt.Errorf("SIOCSIFFLAGS lo: %w", errno)
		}
	}
	return req.flags, nil
}

func main() {
	command := os.Getenv("CNI_COMMAND")
	if command == "VERSION" {
		_ = json.NewEncoder(os.Stdout).Encode(map[string]any{"cniVersion": "1.0.0", "supportedVersions": supported})
		return
	}
	raw, err := io.ReadAll(os.Stdin)
	if err != nil {
		fail("", 4, "cannot read the network configuration", err)
	}
	var conf netConf
	if err := json.Unmarshal(raw, &conf); err != nil {
		fail("", 6, "the network configuration is not JSON", err)
	}
	netns := os.Getenv("CNI_NETNS")
	switch command {
	case "ADD":
		if netns == "" {
			fail(conf.CNIVersion, 4, "CNI_NETNS is not set", nil)
		}
		if err := withNetns(netns, func() error { _, err := loFlags(true); return err }); err != nil {
			fail(conf.CNIVersion, 11, "cannot bring lo up in the pod's network namespace", err)
		}
		result := map[string]any{
			"cniVersion": conf.CNIVersion,
			"interfaces": []map[string]string{{"name": "lo", "sandbox": netns}},
			"ips":        []map[string]string{{"address": "127.0.0.1/8"}},
		}
		_ = json.NewEncoder(os.Stdout).Encode(result)
	case "DEL", "GC":
		// nothing was made outside the namespace, and the namespace goes with the sandbox
	case "CHECK", "STATUS":
		if command == "CHECK" {
			var flags uint16
			err := withNetns(netns, func() error { var e error; flags, e = loFlags(false); return e })
			if err != nil {
				fail(conf.CNIVersion, 11, "cannot read lo in the pod's network namespace", err)
			}
			if flags&syscall.IFF_UP == 0 {
				fail(conf.CNIVersion, 11, "lo is down in the pod's network namespace", nil)
			}
		}
	default:
		fail(conf.CNIVersion, 4, fmt.Sprintf("unknown CNI_COMMAND %q", command), nil)
	}
}
