package containerd_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// requireEnv names the variable that makes a missing containerd a test
// failure instead of a skip; .ci/run sets it after installing containerd.
const requireEnv = "EVENTMONITOR_REQUIRE_CONTAINERD"

// skipUnless skips t for a reason the machine cannot help, or fails it when
// CI asked for the daemon tests to run.
func skipUnless(t *testing.T, ok bool, reason string) {
	t.Helper()
	if ok {
		return
	}
	if os.Getenv(requireEnv) != "" {
		t.Fatalf("%s (and %s is set)", reason, requireEnv)
	}
	t.Skip(reason)
}

// daemon is a containerd started from the machine's package, with its
// config, state and socket in a short temp dir.
type daemon struct {
	t        *testing.T
	dir      string
	socket   string
	isolated bool // in a private mount namespace with dir/run on /run
	cmd      *exec.Cmd
	log      *bytes.Buffer
}

// startDaemon starts containerd and waits until it answers. An isolated
// daemon can run containers without touching the machine's /run.
func startDaemon(t *testing.T, isolated bool) *daemon {
	t.Helper()
	_, err := exec.LookPath("containerd")
	skipUnless(t, err == nil, "containerd is not installed: apt-get install -y containerd")
	_, err = exec.LookPath("ctr")
	skipUnless(t, err == nil, "ctr is not installed: apt-get install -y containerd")
	// A unix socket path must stay short, so not t.TempDir under $TMPDIR.
	dir, err := os.MkdirTemp("/tmp", "emcd")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	d := &daemon{t: t, dir: dir, socket: filepath.Join(dir, "containerd.sock"), isolated: isolated}
	config := fmt.Sprintf(`version = 2
root = %[1]q
state = %[2]q
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs"]
[grpc]
  address = %[3]q
[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = %[4]q
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), d.socket, filepath.Join(dir, "opt"))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "config.toml"), []byte(config), 0o600))
	require.NoError(t, os.Mkdir(filepath.Join(dir, "run"), 0o700))
	d.start()
	t.Cleanup(d.stop)
	return d
}

func (d *daemon) start() {
	t := d.t
	t.Helper()
	config := filepath.Join(d.dir, "config.toml")
	if d.isolated {
		// The shim and runc use /run by fixed paths: give them our own.
		d.cmd = exec.Command("unshare", "-m", "--propagation", "private", "sh", "-c",
			`mount --bind "$1" /run && exec containerd --config "$2"`, "sh", filepath.Join(d.dir, "run"), config)
	} else {
		d.cmd = exec.Command("containerd", "--config", config)
	}
	d.log = &bytes.Buffer{}
	d.cmd.Stdout, d.cmd.Stderr = d.log, d.log
	require.NoError(t, d.cmd.Start())
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := d.ctr("version"); err == nil {
			return
		}
		if time.Now().After(deadline) {
			d.stop()
			t.Fatalf("containerd did not become ready; its log:\n%s", d.log)
		}
		time.Sleep(20 * time.Millisecond) // polling readiness with a deadline
	}
}

// stop ends the daemon with SIGTERM and waits for it.
func (d *daemon) stop() {
	if d.cmd == nil {
		return
	}
	d.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { d.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		d.cmd.Process.Kill()
		<-done
	}
	d.cmd = nil
}

// kill ends the daemon with SIGKILL, as a crash would, and waits for it.
func (d *daemon) kill() {
	d.cmd.Process.Kill()
	d.cmd.Wait()
	d.cmd = nil
}

// ctr runs ctr against the daemon, in its mount namespace if it has one.
func (d *daemon) ctr(args ...string) (string, error) {
	name, args := "ctr", append([]string{"--address", d.socket}, args...)
	if d.isolated && d.cmd != nil {
		mountNS := fmt.Sprintf("--mount=/proc/%d/ns/mnt", d.cmd.Process.Pid)
		name, args = "nsenter", append([]string{mountNS, "ctr"}, args...)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

func (d *daemon) mustCtr(args ...string) string {
	d.t.Helper()
	out, err := d.ctr(args...)
	require.NoError(d.t, err, "ctr %v: %s", args, out)
	return out
}
