package containerd_test

import (
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/eventmonitor/eventmonitor/containerd/containerdtest"
)

// testDaemon is a test's containerd (containerdtest.Start), with helpers
// that fail the test.
type testDaemon struct {
	*containerdtest.Daemon
	t *testing.T
}

// startDaemon starts containerd and waits until it serves. An isolated
// daemon can run containers without touching the machine's /run.
func startDaemon(t *testing.T, isolated bool) *testDaemon {
	t.Helper()
	var opts []containerdtest.Option
	if isolated {
		opts = append(opts, containerdtest.Isolated())
	}
	return &testDaemon{Daemon: containerdtest.Start(t, opts...), t: t}
}

// restart starts the daemon again after Stop or Kill.
func (d *testDaemon) restart() {
	d.t.Helper()
	require.NoError(d.t, d.Restart())
}

func (d *testDaemon) mustCtr(args ...string) string {
	d.t.Helper()
	out, err := d.Ctr(args...)
	require.NoError(d.t, err)
	return out
}

// major is the daemon's major version.
func (d *testDaemon) major() int {
	d.t.Helper()
	v, err := d.Version()
	require.NoError(d.t, err)
	major, _, _ := strings.Cut(strings.TrimPrefix(v, "v"), ".")
	n, err := strconv.Atoi(major)
	require.NoError(d.t, err, "server version %q", v)
	return n
}
