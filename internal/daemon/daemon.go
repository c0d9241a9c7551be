// Package daemon starts a containerd from the machine's PATH with its
// config, state and socket in a short temporary directory, for this
// repository's tests and benchmarks. It needs nothing but the standard
// library, so that every module of the repository can use it.
package daemon

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// ErrNotInstalled: containerd or ctr is not on PATH.
var ErrNotInstalled = errors.New("containerd is not installed (apt-get install -y containerd)")

// Daemon is one containerd with everything in Dir.
type Daemon struct {
	Dir    string
	Socket string

	isolated bool // in a private mount namespace with Dir/run on /run
	cmd      *exec.Cmd
	log      *logBuffer
}

// Start starts a daemon and waits until it answers. An isolated daemon runs
// in a private mount namespace with its own /run, so that it can run
// containers without touching the machine's. Remove it when done.
func Start(isolated bool) (*Daemon, error) {
	for _, tool := range []string{"containerd", "ctr"} {
		if _, err := exec.LookPath(tool); err != nil {
			return nil, fmt.Errorf("%w: no %s", ErrNotInstalled, tool)
		}
	}
	// A unix socket path must stay short, so not under a long $TMPDIR.
	dir, err := os.MkdirTemp("/tmp", "emcd")
	if err != nil {
		return nil, err
	}
	d := &Daemon{Dir: dir, Socket: filepath.Join(dir, "containerd.sock"), isolated: isolated}
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
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), d.Socket, filepath.Join(dir, "opt"))
	if err := os.WriteFile(filepath.Join(dir, "config.toml"), []byte(config), 0o600); err == nil {
		err = os.Mkdir(filepath.Join(dir, "run"), 0o700)
	}
	if err == nil {
		err = d.Restart()
	}
	if err != nil {
		d.Remove()
		return nil, err
	}
	return d, nil
}

// Restart starts the daemon again after Stop or Kill, on the same socket
// and state, and waits until it answers.
func (d *Daemon) Restart() error {
	config := filepath.Join(d.Dir, "config.toml")
	if d.isolated {
		// The shim and runc use /run by fixed paths: give them our own.
		d.cmd = exec.Command("unshare", "-m", "--propagation", "private", "sh", "-c",
			`mount --bind "$1" /run && exec containerd --config "$2"`, "sh", filepath.Join(d.Dir, "run"), config)
	} else {
		d.cmd = exec.Command("containerd", "--config", config)
	}
	d.log = &logBuffer{}
	d.cmd.Stdout, d.cmd.Stderr = d.log, d.log
	if err := d.cmd.Start(); err != nil {
		return err
	}
	for deadline := time.Now().Add(20 * time.Second); ; {
		if _, err := d.Ctr("version"); err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			d.Stop()
			return fmt.Errorf("containerd did not become ready; its log:\n%s", d.Log())
		}
		time.Sleep(20 * time.Millisecond) // polling readiness with a deadline
	}
}

// Stop ends the daemon with SIGTERM and waits for it (SIGKILL after 15 s).
func (d *Daemon) Stop() {
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

// Kill ends the daemon with SIGKILL, as a crash would, and waits for it.
func (d *Daemon) Kill() {
	if d.cmd == nil {
		return
	}
	d.cmd.Process.Kill()
	d.cmd.Wait()
	d.cmd = nil
}

// Remove stops the daemon and removes its directory.
func (d *Daemon) Remove() {
	d.Stop()
	os.RemoveAll(d.Dir)
}

// Ctr runs ctr against the daemon, in its mount namespace if it has one.
func (d *Daemon) Ctr(args ...string) (string, error) {
	name, args := "ctr", append([]string{"--address", d.Socket}, args...)
	if d.isolated && d.cmd != nil {
		mountNS := fmt.Sprintf("--mount=/proc/%d/ns/mnt", d.cmd.Process.Pid)
		name, args = "nsenter", append([]string{mountNS, "ctr"}, args...)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

// Log is what the daemon has written since it last started.
func (d *Daemon) Log() string {
	if d.log == nil {
		return ""
	}
	return d.log.String()
}

// logBuffer is a buffer the daemon writes to while tests read it.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
