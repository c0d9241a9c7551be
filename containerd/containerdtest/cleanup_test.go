package containerdtest

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestRemoveWithoutTheDaemon leaves a killed daemon that cannot start again
// with a running and a paused container: Remove kills the shims and the
// containers' processes (thawing the paused one first), removes their
// cgroups, and says what it had to kill.
func TestRemoveWithoutTheDaemon(t *testing.T) {
	t.Parallel()
	d := Start(t, Isolated())
	const ns = "cdt-fallback"
	pids := map[string]int{}
	for _, id := range []string{"running", "paused"} {
		require.NoError(t, d.Run(ns, id, Process{Release: "never"}))
		require.Eventually(t, func() bool {
			pids[id] = taskPid(d, ns, id)
			return pids[id] > 0
		}, 20*time.Second, 10*time.Millisecond)
		shim, err := d.ShimPid(ns, id)
		require.NoError(t, err)
		pids[id+" shim"] = shim
	}
	_, err := d.Ctr("-n", ns, "tasks", "pause", "paused")
	require.NoError(t, err)
	d.Kill()
	require.NoError(t, os.WriteFile(filepath.Join(d.dir, "config.toml"), []byte("not a config"), 0o600))

	err = d.Remove()
	require.Error(t, err)
	assert.Contains(t, err.Error(), "starting the daemon again")
	assert.Contains(t, err.Error(), "outlived the daemon; killed it")
	assert.Contains(t, err.Error(), fmt.Sprintf("of container %s/paused outlived it; killed them", ns))
	for what, pid := range pids {
		assert.False(t, alive(pid), "%s (pid %d) is still running", what, pid)
	}
	left, _ := filepath.Glob(filepath.Join(cgroupRoot, "*", d.cgroupParent()))
	assert.Empty(t, left, "cgroups left behind")
	assert.NoDirExists(t, d.dir)
	assert.NoError(t, d.Remove(), "a second Remove has nothing to do")
}

// taskPid is the pid ctr lists for the running task of container id, or 0.
func taskPid(d *Daemon, ns, id string) int {
	out, _ := d.Ctr("-n", ns, "tasks", "ls")
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == id && f[2] == "RUNNING" {
			pid, _ := strconv.Atoi(f[1])
			return pid
		}
	}
	return 0
}

func alive(pid int) bool {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	fields := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
	return len(fields) > 0 && fields[0] != "Z" && fields[0] != "X"
}
