package containerdtest

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// cgroupRoot is where the machine's cgroup hierarchies are mounted.
const cgroupRoot = "/sys/fs/cgroup"

// cleanup deletes what is left in the daemon, then, with the daemon
// stopped, kills what outlived that and removes the cgroups runc made.
func (d *Daemon) cleanup() []error {
	var errs []error
	d.mu.Lock()
	running := d.cmd != nil
	d.mu.Unlock()
	if !running && len(d.shims()) > 0 {
		if err := d.Restart(); err != nil {
			errs = append(errs, fmt.Errorf("starting the daemon again to delete its tasks: %w", err))
		} else {
			running = true
		}
	}
	var containers []string // namespace/id
	if running {
		out, err := d.Ctr("namespaces", "ls", "-q")
		if err != nil {
			errs = append(errs, err)
		}
		for _, ns := range strings.Fields(out) {
			d.useNamespace(ns)
			ids, err := d.deleteAll(ns)
			errs = append(errs, err...)
			for _, id := range ids {
				containers = append(containers, ns+"/"+id)
			}
		}
	}
	d.Stop()

	for _, s := range d.shims() {
		errs = append(errs, fmt.Errorf("shim %d of %s/%s outlived the daemon; killed it", s.pid, s.ns, s.id))
		syscall.Kill(s.pid, syscall.SIGKILL)
	}
	d.mu.Lock()
	var spaces []string
	for ns := range d.spaces {
		spaces = append(spaces, ns)
	}
	d.mu.Unlock()
	errs = append(errs, removeCgroups(d.cgroupParent(), spaces, containers)...)
	return errs
}

// deleteAll deletes every task and container in namespace ns, and returns
// the IDs of the containers.
func (d *Daemon) deleteAll(ns string) ([]string, []error) {
	var errs []error
	out, err := d.Ctr("-n", ns, "tasks", "ls")
	if err != nil {
		errs = append(errs, err)
	}
	var tasks []string
	for _, line := range strings.Split(out, "\n") {
		// TASK PID STATUS, after a header.
		f := strings.Fields(line)
		if len(f) != 3 || f[0] == "TASK" {
			continue
		}
		tasks = append(tasks, f[0])
		if f[2] == "PAUSED" || f[2] == "PAUSING" {
			// A frozen process does not die of SIGKILL until it is thawed.
			if _, err := d.Ctr("-n", ns, "tasks", "resume", f[0]); err != nil {
				errs = append(errs, err)
			}
		}
	}
	errs = append(errs, parallel(tasks, func(id string) error {
		_, err := d.Ctr("-n", ns, "tasks", "delete", "--force", id)
		return err
	})...)
	out, err = d.Ctr("-n", ns, "containers", "ls", "-q")
	if err != nil {
		errs = append(errs, err)
	}
	ids := strings.Fields(out)
	errs = append(errs, parallel(ids, func(id string) error {
		_, err := d.Ctr("-n", ns, "containers", "delete", id)
		return err
	})...)
	return ids, errs
}

// parallel calls f for each item, a few at a time, and returns its errors
// but those saying that the thing is already gone.
func parallel(items []string, f func(string) error) []error {
	var (
		mu   sync.Mutex
		errs []error
		wg   sync.WaitGroup
		sem  = make(chan struct{}, 8)
	)
	for _, item := range items {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			if err := f(item); err != nil && !strings.Contains(err.Error(), "not found") {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return errs
}

// removeCgroups removes the cgroups runc made: parent's, where Run puts
// its containers, those of other containers (namespace/id) where runc puts
// them by default, /<namespace>/<id>, and the namespaces' cgroups. A process
// still in one outlived its container: it is killed.
//
// A namespace's cgroup is removed only if it is empty, since another
// containerd may use a namespace of the same name.
func removeCgroups(parent string, spaces, containers []string) []error {
	var errs []error
	hierarchies, _ := filepath.Glob(filepath.Join(cgroupRoot, "*"))
	hierarchies = append(hierarchies, cgroupRoot) // v2, or none
	type cgroup struct{ dir, container string }
	var cgroups []cgroup // in every hierarchy, parents first
	walk := func(root string, container func(path string) string) {
		filepath.WalkDir(root, func(path string, e fs.DirEntry, err error) error {
			if err == nil && e.IsDir() {
				cgroups = append(cgroups, cgroup{path, container(path)})
			}
			return nil
		})
	}
	for _, h := range hierarchies {
		root := filepath.Join(h, parent)
		walk(root, func(path string) string {
			// <parent>/<namespace>/<id>/...
			rel, _ := filepath.Rel(root, path)
			f := strings.SplitN(rel, "/", 3)
			if len(f) < 2 {
				return ""
			}
			return f[0] + "/" + f[1]
		})
		for _, c := range containers {
			walk(filepath.Join(h, c), func(string) string { return c })
		}
	}
	// A frozen process does not die of SIGKILL until it is thawed, which is
	// done in the freezer's hierarchy, not the one its pid is read from.
	for _, c := range cgroups {
		writeExisting(filepath.Join(c.dir, "freezer.state"), "THAWED") // v1
		writeExisting(filepath.Join(c.dir, "cgroup.freeze"), "0")      // v2
	}
	killed := map[string][]int{}
	var order []string
	for _, c := range cgroups {
		for _, pid := range procs(c.dir) {
			if _, ok := killed[c.container]; !ok {
				order = append(order, c.container)
			}
			if !slices.Contains(killed[c.container], pid) {
				killed[c.container] = append(killed[c.container], pid)
			}
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	for _, c := range order {
		errs = append(errs, fmt.Errorf("processes %v of container %s outlived it; killed them", killed[c], c))
	}
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		if !slices.ContainsFunc(cgroups, func(c cgroup) bool { return len(procs(c.dir)) > 0 }) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	for i := len(cgroups) - 1; i >= 0; i-- { // children first
		if err := syscall.Rmdir(cgroups[i].dir); err != nil && !errors.Is(err, syscall.ENOENT) {
			errs = append(errs, fmt.Errorf("removing cgroup %s: %w", cgroups[i].dir, err))
		}
	}
	for _, ns := range spaces {
		for _, h := range hierarchies {
			if dir := filepath.Join(h, ns); isDir(dir) {
				err := syscall.Rmdir(dir)
				if err != nil && !errors.Is(err, syscall.EBUSY) && !errors.Is(err, syscall.ENOTEMPTY) && !errors.Is(err, syscall.ENOENT) {
					errs = append(errs, fmt.Errorf("removing cgroup %s: %w", dir, err))
				}
			}
		}
	}
	return errs
}

// procs is the processes in the cgroup at dir, not its descendants.
func procs(dir string) []int {
	b, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids
}

// writeExisting writes data to the file at path if there is one.
func writeExisting(path, data string) {
	if f, err := os.OpenFile(path, os.O_WRONLY, 0); err == nil {
		f.WriteString(data)
		f.Close()
	}
}

func isDir(path string) bool {
	info, err := os.Stat(path)
	return err == nil && info.IsDir()
}
