package main

import (
	"context"
	"io"
	"net"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/containerd/log"

	"github.com/eventmonitor/eventmonitor/containerd/containerdtest"
)

// nodewatch against a private containerd running real containers: the page
// shows each one's task and exit, a deleted one's tombstone, and an exit
// made while the daemon was down; /metrics has the informers' metrics.
func TestNodewatchShowsRealContainers(t *testing.T) {
	d := containerdtest.Start(t, containerdtest.Isolated()) // skips without containerd, unless EVENTMONITOR_REQUIRE_CONTAINERD is set
	log.L.Logger.SetOutput(testLog{t})
	const ns = "nodewatch-test"
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx, d.Address(), ns, ln) }()
	t.Cleanup(func() { // before the daemon's removal, registered earlier
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("run: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Error("run did not return 10 s after its ctx ended")
		}
	})
	base := "http://" + ln.Addr().String()

	must(t, d.Run(ns, "exits-3", containerdtest.Process{ExitCode: 3}))
	must(t, d.Run(ns, "waits", containerdtest.Process{Release: "waits"}))
	must(t, d.Run(ns, "oom", containerdtest.Process{OOM: true}, "--memory-limit", "33554432"))
	must(t, d.ImportImage(ns, "docker.io/library/nodewatch-test:1"))
	eventually(t, base+"/", `<td>exits-3</td><td></td><td>stopped</td><td>\d+</td><td>3</td>`,
		`<td>waits</td><td></td><td>running</td><td>\d+</td><td></td>`,
		// Not always "137 (OOM)": TaskOOM can come just after the exit, and
		// the informer then drops it as older news.
		`<td>oom</td><td></td><td>stopped</td><td>\d+</td><td>137( \(OOM\))?</td>`,
		`<td>docker.io/library/nodewatch-test:1</td><td>sha256:[0-9a-f]{64}</td>`)

	_, err = d.Ctr("-n", ns, "tasks", "delete", "exits-3")
	must(t, err)
	_, err = d.Ctr("-n", ns, "containers", "delete", "exits-3")
	must(t, err)
	page := eventually(t, base+"/", `Recently deleted.*<td>exits-3</td><td></td><td>task deleted</td><td>\d+</td><td>3</td>`)
	if strings.Count(page, "<td>exits-3</td>") != 1 {
		t.Errorf("exits-3 is still among the containers:\n%s", page)
	}

	d.Kill() // the stream may miss what happens now; the relist after the restart does not
	must(t, d.Release("waits"))
	must(t, d.Restart())
	exited := `<td>waits</td><td></td><td>stopped</td><td>\d+</td><td>0</td>`
	if v, _ := d.Version(); !strings.HasPrefix(strings.TrimPrefix(v, "v"), "1.") {
		// containerd 2 removes at start the tasks whose process ended while
		// it was down, and their exit status with them.
		exited = `<td>waits</td><td></td><td>task deleted</td><td>\d+</td><td>unknown</td>`
	}
	eventually(t, base+"/", exited)

	eventually(t, base+"/metrics",
		`nodewatch_informer_objects\{informer="container"\} 2\n`,
		`nodewatch_informer_objects\{informer="image"\} 1\n`,
		`nodewatch_informer_relists_total\{informer="container"\} [2-9]`, // the first listing and the one after the restart
		`eventmonitor_events_handled_total\{informer="container"\} [1-9]`,
		`eventmonitor_events_handled_total\{informer="image"\} 1\n`)
}

// eventually fetches url until its body matches every pattern, and returns
// it; patterns match across lines.
func eventually(t *testing.T, url string, patterns ...string) string {
	t.Helper()
	var body string
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		body = get(t, url)
		matched := true
		for _, p := range patterns {
			matched = matched && regexp.MustCompile("(?s)"+p).MatchString(body)
		}
		if matched {
			return body
		}
	}
	t.Fatalf("%s never matched %q; last:\n%s", url, patterns, body)
	return ""
}

func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	must(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	must(t, err)
	return string(b)
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// testLog shows nodewatch's log lines with the test's output.
type testLog struct{ t *testing.T }

func (w testLog) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}
