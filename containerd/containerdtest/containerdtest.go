// Package containerdtest starts a private containerd for tests of programs
// that watch one, such as node agents built on this module, and drives real
// workloads in it.
//
// [Start] gives a test its own daemon, with its config, state and socket in a
// temporary directory, and removes it all when the test ends. It uses the
// containerd and ctr on PATH (Debian's package: containerd 1.6), or those in a
// directory given with [WithBinDir] (a containerd 2.x build). It needs root.
// When containerd cannot run, the test is skipped, unless the environment
// variable named by [RequireEnv] is set, as CI should: then it fails.
//
// A daemon started with [Isolated] runs, with every ctr call made through
// [Daemon.Ctr], in a private mount namespace with its own /run, so that real
// runc containers run without touching the machine's containerd state.
// [Daemon.Run] starts one with a small static test program that exits with a
// given code, waits for [Daemon.Release] first, or allocates memory until it
// is OOM-killed; [Daemon.ImportImage] imports an OCI image of the same program.
//
// The containers of Run and RunImage get cgroups under one of the daemon's
// own. Those made with ctr run directly get runc's default, named after
// their namespace and ID on the whole machine: give them namespaces of your
// own.
package containerdtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// RequireEnv names the environment variable that, when set, makes [Start]
// fail a test instead of skipping it when containerd cannot run.
const RequireEnv = "EVENTMONITOR_REQUIRE_CONTAINERD"

// ErrUnavailable is returned, wrapped with what is missing, when containerd
// cannot run on this machine: a tool is not installed or this is not root.
var ErrUnavailable = errors.New("containerd cannot run here")

// installHint says how to get what the package needs on the machines this
// project tests on.
const installHint = "apt-get install -y containerd (containerd 1.6 with ctr and runc), as root"

// Option configures a daemon.
type Option func(*config)

type config struct {
	bin      string
	isolated bool
}

// WithBinDir runs containerd, ctr and containerd-shim-runc-v2 from dir
// instead of PATH, for example a containerd 2.x build.
func WithBinDir(dir string) Option { return func(c *config) { c.bin = dir } }

// Isolated runs the daemon, its shims and every [Daemon.Ctr] call in a private
// mount namespace with a private /run, so that it can run real containers.
// It needs unshare, nsenter and runc.
func Isolated() Option { return func(c *config) { c.isolated = true } }

// Daemon is one private containerd. Its methods may be called from several
// goroutines.
type Daemon struct {
	dir      string
	socket   string
	isolated bool
	env      []string // PATH with the bin directory first, when there is one
	daemon   string   // the containerd binary
	ctr      string   // the ctr binary

	mu      sync.Mutex
	cmd     *exec.Cmd
	exited  chan struct{} // closed when cmd has exited
	removed bool
	log     logBuffer
	spaces  map[string]bool // namespaces ctr has been told to use, for cleanup

	rootfsOnce sync.Once
	rootfs     string
	rootfsErr  error
}

// Start starts a daemon for t and removes it, with every container and task
// left in it and their cgroups, when t ends. It skips t, or fails it if
// [RequireEnv] is set, when containerd cannot run here.
func Start(t testing.TB, opts ...Option) *Daemon {
	t.Helper()
	d, err := New(opts...)
	if errors.Is(err, ErrUnavailable) {
		if os.Getenv(RequireEnv) != "" {
			t.Fatalf("containerdtest: %v (and %s is set)", err, RequireEnv)
		}
		t.Skipf("containerdtest: %v", err)
	}
	if err != nil {
		t.Fatalf("containerdtest: %v", err)
	}
	t.Cleanup(func() {
		if err := d.Remove(); err != nil {
			t.Errorf("containerdtest: cleaning up: %v", err)
		}
	})
	return d
}

// New starts a daemon for a program that is not a test, such as a benchmark,
// and waits until it serves. The caller must call [Daemon.Remove]. The error
// wraps [ErrUnavailable] when containerd cannot run here.
func New(opts ...Option) (*Daemon, error) {
	var c config
	for _, o := range opts {
		o(&c)
	}
	d := &Daemon{isolated: c.isolated, spaces: map[string]bool{}}
	if err := d.lookTools(c); err != nil {
		return nil, err
	}
	// Not under $TMPDIR, which may be long: a unix socket path must stay
	// under about 100 bytes.
	dir, err := os.MkdirTemp("/tmp", "cdt")
	if err != nil {
		return nil, err
	}
	d.dir, d.socket = dir, filepath.Join(dir, "containerd.sock")
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
	err = os.WriteFile(filepath.Join(dir, "config.toml"), []byte(config), 0o600)
	if err == nil {
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

// lookTools finds what the daemon will run and sets d's environment for it.
func (d *Daemon) lookTools(c config) error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("%w: containerd needs root (%s)", ErrUnavailable, installHint)
	}
	path := os.Getenv("PATH")
	if c.bin != "" {
		bin, err := filepath.Abs(c.bin)
		if err != nil {
			return err
		}
		// First on the daemon's PATH too: containerd looks its shim up there.
		path = bin + string(os.PathListSeparator) + path
		d.env = append(os.Environ(), "PATH="+path)
	}
	tools := []string{"containerd", "ctr"}
	if c.isolated {
		tools = append(tools, "unshare", "nsenter", "runc")
	}
	for _, tool := range tools {
		found := lookPath(tool, path)
		if found == "" {
			where := "on PATH"
			if c.bin != "" {
				where = "in " + c.bin + " or on PATH"
			}
			return fmt.Errorf("%w: no %s %s (%s)", ErrUnavailable, tool, where, installHint)
		}
		switch tool {
		case "containerd":
			d.daemon = found
		case "ctr":
			d.ctr = found
		}
	}
	return nil
}

// lookPath is where tool is in path, or "".
func lookPath(tool, path string) string {
	for _, dir := range filepath.SplitList(path) {
		file := filepath.Join(dir, tool)
		if info, err := os.Stat(file); err == nil && !info.IsDir() && info.Mode()&0o111 != 0 {
			return file
		}
	}
	return ""
}

// Address is the path of the daemon's gRPC socket.
func (d *Daemon) Address() string { return d.socket }

// Restart starts the daemon again after [Daemon.Stop] or [Daemon.Kill], with
// the same state and socket, and waits until it serves.
func (d *Daemon) Restart() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.removed {
		return errors.New("the daemon was removed")
	}
	if d.cmd != nil {
		return errors.New("the daemon is running")
	}
	config := filepath.Join(d.dir, "config.toml")
	var cmd *exec.Cmd
	if d.isolated {
		// The shims and runc use /run by fixed paths: give them our own. A
		// restart makes a new namespace with the same directory on /run, where
		// the shims that outlived the last daemon are found again.
		cmd = exec.Command("unshare", "-m", "--propagation", "private", "sh", "-c",
			`mount --bind "$1" /run && exec "$2" --config "$3"`, "sh", filepath.Join(d.dir, "run"), d.daemon, config)
	} else {
		cmd = exec.Command(d.daemon, "--config", config)
	}
	cmd.Env = d.env
	cmd.Stdout, cmd.Stderr = &d.log, &d.log
	d.log.mark("containerdtest: starting the daemon")
	if err := cmd.Start(); err != nil {
		return err
	}
	exited := make(chan struct{})
	go func() {
		cmd.Wait()
		close(exited)
	}()
	d.cmd, d.exited = cmd, exited

	for deadline := time.Now().Add(30 * time.Second); ; {
		// ctr waits 10 s to connect by default: the daemon may have failed.
		_, err := d.runCtr(d.mountPid(), "--connect-timeout", "1s", "version")
		if err == nil {
			return nil
		}
		select {
		case <-exited:
			d.cmd = nil
			return fmt.Errorf("containerd exited at start (%v); its log:\n%s", cmd.ProcessState, d.log.String())
		default:
		}
		if time.Now().After(deadline) {
			d.stopLocked(syscall.SIGKILL)
			return fmt.Errorf("containerd did not serve within 30 s (%v); its log:\n%s", err, d.log.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Stop ends the daemon with SIGTERM and waits for it to exit, killing it
// after 15 s. Its shims, and so its containers, keep running.
func (d *Daemon) Stop() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.stopLocked(syscall.SIGTERM)
}

// Kill ends the daemon with SIGKILL, as a crash would, and waits for it to
// exit. Its shims, and so its containers, keep running.
func (d *Daemon) Kill() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.stopLocked(syscall.SIGKILL)
}

func (d *Daemon) stopLocked(sig syscall.Signal) {
	if d.cmd == nil {
		return
	}
	d.cmd.Process.Signal(sig)
	select {
	case <-d.exited:
	case <-time.After(15 * time.Second):
		d.cmd.Process.Kill()
		<-d.exited
	}
	d.log.mark(fmt.Sprintf("containerdtest: the daemon ended (%v)", d.cmd.ProcessState))
	d.cmd = nil
}

// Ctr runs ctr against the daemon, inside its mount namespace when it is
// isolated, and returns its standard output, trimmed. An error from ctr
// wraps its [*exec.ExitError] and holds its standard error.
func (d *Daemon) Ctr(args ...string) (string, error) {
	d.mu.Lock()
	if ns := namespaceOf(args); ns != "" {
		d.spaces[ns] = true
	}
	pid := d.mountPid()
	d.mu.Unlock()
	return d.runCtr(pid, args...)
}

// mountPid is the process whose mount namespace ctr must run in, or 0.
func (d *Daemon) mountPid() int {
	if !d.isolated || d.cmd == nil {
		return 0
	}
	return d.cmd.Process.Pid
}

// runCtr runs ctr in the mount namespace of process pid, if not 0.
func (d *Daemon) runCtr(pid int, ctrArgs ...string) (string, error) {
	name, args := d.ctr, append([]string{"--address", d.socket}, ctrArgs...)
	if pid != 0 {
		// ctr makes its containers' stdio FIFOs under /run.
		name, args = "nsenter", append([]string{fmt.Sprintf("--mount=/proc/%d/ns/mnt", pid), "--", d.ctr}, args...)
	}
	// A wedged daemon must not hang a test forever.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = d.env
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	out := strings.TrimSpace(stdout.String())
	if err != nil {
		return out, fmt.Errorf("ctr %s: %w: %s", strings.Join(ctrArgs, " "), err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}

// Version is the daemon's version as it reports it, such as "1.6.20~ds1" or
// "v2.4.2".
func (d *Daemon) Version() (string, error) {
	out, err := d.Ctr("version")
	if err != nil {
		return "", err
	}
	_, server, _ := strings.Cut(out, "Server:")
	for _, line := range strings.Split(server, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "Version:"); ok {
			return strings.TrimSpace(v), nil
		}
	}
	return "", fmt.Errorf("no server version in %q", out)
}

// Log is everything the daemon has written, over all its starts.
func (d *Daemon) Log() string { return d.log.String() }

// Remove deletes every task and container left in the daemon, so that no
// shim outlives it, stops it, and removes its containers' cgroups and its
// directory. A daemon that is down is started again first if shims of it
// are still running. The error says what had to be killed without it.
func (d *Daemon) Remove() error {
	d.mu.Lock()
	if d.removed {
		d.mu.Unlock()
		return nil
	}
	d.mu.Unlock()
	var errs []error
	if d.dir != "" {
		errs = d.cleanup()
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.stopLocked(syscall.SIGTERM)
	d.removed = true
	if d.dir != "" {
		if err := os.RemoveAll(d.dir); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// useNamespace records ns for the cgroup cleanup.
func (d *Daemon) useNamespace(ns string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.spaces[ns] = true
}

// namespaceOf is the namespace ctr's global flags args name, or "".
func namespaceOf(args []string) string {
	for i, a := range args {
		if !strings.HasPrefix(a, "-") {
			return "" // the command: global flags come before it
		}
		if a == "-n" || a == "--namespace" {
			if i+1 < len(args) {
				return args[i+1]
			}
			return ""
		}
		for _, p := range []string{"-n=", "--namespace="} {
			if ns, ok := strings.CutPrefix(a, p); ok {
				return ns
			}
		}
	}
	return ""
}

// logBuffer is the daemon's log, written by it while tests read it.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) mark(line string) {
	b.Write([]byte(line + " at " + time.Now().Format(time.RFC3339Nano) + "\n"))
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// procArgs is the command line of process pid, or nil if there is none.
func procArgs(pid int) []string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	if err != nil || len(b) == 0 {
		return nil
	}
	return strings.Split(strings.TrimSuffix(string(b), "\x00"), "\x00")
}
