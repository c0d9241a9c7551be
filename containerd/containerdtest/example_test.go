package containerdtest_test

import (
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/eventmonitor/eventmonitor/containerd/containerdtest"
)

// A test of a node agent gives it a private containerd, runs real
// containers in it, and crashes and restarts the daemon under it.
func ExampleStart() {
	var t *testing.T // the test's own, in a func TestAgent(t *testing.T)

	d := containerdtest.Start(t, containerdtest.Isolated())
	conn, err := grpc.NewClient("unix://"+d.Address(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// ... start the agent under test on conn ...

	const ns = "agent-test"
	if err := d.Run(ns, "exits-0", containerdtest.Process{}); err != nil {
		t.Fatal(err)
	}
	if err := d.Run(ns, "waits", containerdtest.Process{ExitCode: 3, Release: "waits"}); err != nil {
		t.Fatal(err)
	}
	oom := containerdtest.Process{OOM: true}
	if err := d.Run(ns, "oom", oom, "--memory-limit", "33554432"); err != nil {
		t.Fatal(err)
	}
	// ... the agent sees exits-0 exit with 0 and oom killed (137) ...

	d.Kill() // a crash: the containers run on in their shims
	if err := d.Release("waits"); err != nil {
		t.Fatal(err)
	}
	if err := d.Restart(); err != nil {
		t.Fatal(err)
	}
	// ... the agent catches up with what happened while the daemon was down ...

	if err := d.ImportImage(ns, "docker.io/library/agent-test:1"); err != nil {
		t.Fatal(err)
	}
	// ... the agent sees the image ...
}
