package containerdtest

import (
	_ "embed"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
)

//go:embed internal/testprog/main.go
var testprogSource []byte

// Process is what the test program does in a container, as its init process
// or as an exec.
type Process struct {
	// ExitCode is the status the program exits with.
	ExitCode int
	// Release, if set, makes the program wait before exiting until
	// [Daemon.Release] is called with this name.
	Release string
	// OOM makes the program allocate memory until it is killed instead of
	// exiting; give the container a memory limit (ctr run --memory-limit).
	OOM bool
}

// Args is the program's command line in a container of the daemon, for
// composing ctr commands of your own.
func (p Process) Args() []string {
	args := []string{"/testprog", strconv.Itoa(p.ExitCode)}
	if p.OOM {
		args[1] = "oom"
	}
	if p.Release != "" {
		args = append(args, "/release/"+p.Release)
	}
	return args
}

// Rootfs is a directory holding the test program, as /testprog, for a
// container's root filesystem (ctr run --rootfs). It is built, with the go
// command on PATH, the first time it is needed.
func (d *Daemon) Rootfs() (string, error) {
	d.rootfsOnce.Do(func() { d.rootfs, d.rootfsErr = d.buildRootfs() })
	return d.rootfs, d.rootfsErr
}

func (d *Daemon) buildRootfs() (string, error) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		return "", fmt.Errorf("%w: building the test program needs the go command: %v", ErrUnavailable, err)
	}
	rootfs, src := filepath.Join(d.dir, "rootfs"), filepath.Join(d.dir, "testprog")
	for _, dir := range []string{filepath.Join(rootfs, "release"), src} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return "", err
		}
	}
	if err := os.WriteFile(filepath.Join(src, "main.go"), testprogSource, 0o644); err != nil {
		return "", err
	}
	// Static, for an empty root; outside any module and workspace of the
	// caller's, whose settings must not leak into the build.
	cmd := exec.Command(goTool, "build", "-trimpath", "-buildvcs=false", "-o", filepath.Join(rootfs, "testprog"), "main.go")
	cmd.Dir = src
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+runtime.GOARCH, "GOWORK=off", "GOFLAGS=")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("building the test program: %v: %s", err, out)
	}
	return rootfs, nil
}

// Run starts container id in namespace ns, detached, running p from
// [Daemon.Rootfs]. Flags go to ctr run before the container's ID, for example
// "--memory-limit", "33554432" or "--label", "k=v". The daemon must be
// [Isolated].
func (d *Daemon) Run(ns, id string, p Process, flags ...string) error {
	rootfs, err := d.preparedRootfs()
	if err != nil {
		return err
	}
	// --rootfs is a switch: the directory is the first argument after the flags.
	args := append([]string{"-n", ns, "run", "-d", "--null-io", "--cgroup", d.cgroupOf(ns, id)}, flags...)
	_, err = d.Ctr(append(append(args, "--rootfs", rootfs, id), p.Args()...)...)
	return err
}

// RunImage is [Daemon.Run] from image ref, as imported with
// [Daemon.ImportImage], instead of the rootfs; [Daemon.Release] works the
// same.
func (d *Daemon) RunImage(ns, ref, id string, p Process, flags ...string) error {
	rootfs, err := d.preparedRootfs()
	if err != nil {
		return err
	}
	// The image's /release is the rootfs's, where Release puts its files.
	mount := "type=bind,src=" + filepath.Join(rootfs, "release") + ",dst=/release,options=rbind:ro"
	args := append([]string{"-n", ns, "run", "-d", "--null-io", "--cgroup", d.cgroupOf(ns, id), "--mount", mount}, flags...)
	_, err = d.Ctr(append(append(args, ref, id), p.Args()...)...)
	return err
}

// Exec starts p as process execID in the running task of container id,
// detached.
func (d *Daemon) Exec(ns, id, execID string, p Process) error {
	if _, err := d.preparedRootfs(); err != nil {
		return err
	}
	// ctr is gone once the exec has started, so nobody would read stdio
	// FIFOs; like Run's --null-io, the output goes nowhere.
	args := []string{"-n", ns, "task", "exec", "-d", "--log-uri", "file:///dev/null", "--exec-id", execID, id}
	_, err := d.Ctr(append(args, p.Args()...)...)
	return err
}

// cgroupParent is the cgroup, in every hierarchy, under which Run and
// RunImage put their containers: named after the daemon's directory, it is
// this daemon's alone, even beside other tests' daemons and a containerd
// of the machine's that use the same namespaces and IDs.
func (d *Daemon) cgroupParent() string { return "/" + filepath.Base(d.dir) }

func (d *Daemon) cgroupOf(ns, id string) string { return d.cgroupParent() + "/" + ns + "/" + id }

func (d *Daemon) preparedRootfs() (string, error) {
	if !d.isolated {
		return "", errors.New("running containers needs an Isolated daemon, which keeps them off the machine's /run")
	}
	return d.Rootfs()
}

// Release lets every program waiting on name (see [Process.Release]) exit;
// the name stays released, so later ones exit at once.
func (d *Daemon) Release(name string) error {
	if name == "" || strings.ContainsRune(name, '/') {
		return fmt.Errorf("bad release name %q", name)
	}
	rootfs, err := d.Rootfs()
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(rootfs, "release", name), nil, 0o644)
}

// ShimPid is the process ID of the shim of container id in namespace ns, or
// an error if no such shim of this daemon's is running.
func (d *Daemon) ShimPid(ns, id string) (int, error) {
	for _, s := range d.shims() {
		if s.ns == ns && s.id == id {
			return s.pid, nil
		}
	}
	return 0, fmt.Errorf("no shim of %s/%s is running", ns, id)
}

// shim is a shim process of this daemon's.
type shim struct {
	pid    int
	ns, id string
}

// shims finds this daemon's shims by the address on their command line.
func (d *Daemon) shims() []shim {
	entries, _ := os.ReadDir("/proc")
	var out []shim
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		args := procArgs(pid)
		if len(args) == 0 || !strings.HasPrefix(filepath.Base(args[0]), "containerd-shim") {
			continue
		}
		s, ours := shim{pid: pid}, false
		for i := 1; i+1 < len(args); i++ {
			switch args[i] {
			case "-namespace", "--namespace":
				s.ns = args[i+1]
			case "-id", "--id":
				s.id = args[i+1]
			case "-address", "--address":
				ours = args[i+1] == d.socket
			}
		}
		if ours {
			out = append(out, s)
		}
	}
	return out
}
