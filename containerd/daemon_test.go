package containerd_test

import (
	"errors"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/eventmonitor/eventmonitor/internal/daemon"
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

// testDaemon is a test's containerd; it is removed when the test ends.
type testDaemon struct {
	*daemon.Daemon
	t *testing.T
}

// startDaemon starts containerd and waits until it answers. An isolated
// daemon can run containers without touching the machine's /run.
func startDaemon(t *testing.T, isolated bool) *testDaemon {
	t.Helper()
	d, err := daemon.Start(isolated)
	skipUnless(t, !errors.Is(err, daemon.ErrNotInstalled), "containerd is not installed: apt-get install -y containerd")
	require.NoError(t, err)
	t.Cleanup(d.Remove)
	return &testDaemon{Daemon: d, t: t}
}

// restart starts the daemon again after Stop or Kill.
func (d *testDaemon) restart() {
	d.t.Helper()
	require.NoError(d.t, d.Restart())
}

func (d *testDaemon) mustCtr(args ...string) string {
	d.t.Helper()
	out, err := d.Ctr(args...)
	require.NoError(d.t, err, "ctr %v: %s", args, out)
	return out
}
