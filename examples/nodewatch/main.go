// Command nodewatch is a small node agent on the containerd informers: it
// keeps a cached view of one namespace's containers and images, logs every
// change, and serves a self-refreshing page of the containers at / and
// Prometheus metrics at /metrics.
//
//	go run ./nodewatch -address /run/containerd/containerd.sock -namespace k8s.io -http :8080
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"html/template"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/log"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/containerd"
	emprom "github.com/eventmonitor/eventmonitor/prometheus"
)

func main() {
	address := flag.String("address", "/run/containerd/containerd.sock", "containerd's gRPC socket")
	namespace := flag.String("namespace", containerd.K8sNamespace, "the containerd namespace to watch")
	listen := flag.String("http", ":8080", "where to serve the page (/) and the metrics (/metrics)")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ln, err := net.Listen("tcp", *listen)
	if err == nil {
		err = run(ctx, *address, *namespace, ln)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "nodewatch:", err)
		os.Exit(1)
	}
}

// node is the agent's view: the two informers' caches, and the last few
// containers deleted, which the caches no longer hold.
type node struct {
	address, namespace string
	containers         *containerd.Informer[containerd.Container]
	images             *containerd.Informer[containerd.Image]

	mu      sync.Mutex
	deleted []tombstone // newest first
}

type tombstone struct {
	container containerd.Container
	at        time.Time
}

const keepDeleted = 10

// run watches namespace until ctx ends, serving on ln.
func run(ctx context.Context, address, namespace string, ln net.Listener) error {
	defer ln.Close()
	dialCtx, dialed := context.WithTimeout(ctx, 5*time.Second)
	conn, err := containerd.Dial(dialCtx, address) // fails at once, saying why, without a socket
	dialed()
	if err != nil {
		return err
	}
	defer conn.Close()

	n := &node{address: address, namespace: namespace}
	registry := prometheus.NewRegistry()
	containerMetrics, imageMetrics := collector("container"), collector("image")
	n.containers, err = containerd.NewContainerInformer(conn, namespace, n.containerChanged,
		containerd.WithDelivery(eventmonitor.WithMetrics(containerMetrics)))
	if err != nil {
		return err
	}
	n.images, err = containerd.NewImageInformer(conn, namespace, n.imageChanged,
		containerd.WithDelivery(eventmonitor.WithMetrics(imageMetrics)))
	if err != nil {
		return err
	}
	register(registry, "container", containerMetrics, n.containers.Monitor(), n.containers.Stats)
	register(registry, "image", imageMetrics, n.images.Monitor(), n.images.Stats)

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make(chan error, 2)
	for _, inf := range []interface{ Run(context.Context) error }{n.containers, n.images} {
		go func() {
			err := inf.Run(ctx) // nil once ctx ends; it rides out daemon restarts by itself
			cancel()
			errs <- err
		}()
	}
	go func() {
		if n.containers.WaitForSync(ctx) == nil && n.images.WaitForSync(ctx) == nil {
			log.L.WithField("containers", n.containers.Stats().Objects).WithField("images", n.images.Stats().Objects).
				Info("nodewatch: synced")
		}
	}()

	mux := http.NewServeMux()
	mux.HandleFunc("/", n.servePage)
	mux.Handle("/metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			log.L.WithError(err).Error("nodewatch: serving")
			cancel()
		}
	}()
	log.L.Infof("nodewatch: watching %s (namespace %s); page at http://%s/, metrics at /metrics", address, namespace, ln.Addr())

	<-ctx.Done()
	shutdownCtx, cancelShutdown := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancelShutdown()
	err = errors.Join(srv.Shutdown(shutdownCtx), <-errs, <-errs)
	log.L.Info("nodewatch: stopped")
	return err
}

// collector exports the metrics of the monitor that delivers one informer's
// changes, labelled with the informer's kind.
func collector(kind string) *emprom.Collector {
	return emprom.New(emprom.WithConstLabels(prometheus.Labels{"informer": kind}))
}

// register exports an informer's delivery metrics and its own counters,
// which are read from Stats at every scrape.
func register(reg *prometheus.Registry, kind string, c *emprom.Collector, m *eventmonitor.Monitor,
	stats func() containerd.InformerStats) {
	c.Watch(m)
	reg.MustRegister(c)
	labels := prometheus.Labels{"informer": kind}
	for _, s := range []struct {
		name, help string
		counter    bool
		value      func(containerd.InformerStats) float64
	}{
		{"objects", "Objects in the cache.", false, func(s containerd.InformerStats) float64 { return float64(s.Objects) }},
		{"relists_total", "Full listings applied to the cache.", true, func(s containerd.InformerStats) float64 { return float64(s.Relists) }},
		{"corrections_total", "Changes only a listing or a read found: the event stream had missed them.", true,
			func(s containerd.InformerStats) float64 { return float64(s.Corrections) }},
		{"refreshes_total", "Single objects read from the daemon again.", true,
			func(s containerd.InformerStats) float64 { return float64(s.Refreshes) }},
		{"last_relist_seconds", "How long the last full listing took to apply.", false,
			func(s containerd.InformerStats) float64 { return s.LastRelist.Seconds() }},
	} {
		opts := prometheus.Opts{Namespace: "nodewatch", Subsystem: "informer", Name: s.name, Help: s.help, ConstLabels: labels}
		value := func() float64 { return s.value(stats()) }
		if s.counter {
			reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts(opts), value))
		} else {
			reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts(opts), value))
		}
	}
}

// containerChanged logs a change; a deleted container's tombstone is kept
// for the page, as it still says how its task ended.
func (n *node) containerChanged(_ context.Context, ch containerd.Change[containerd.Container]) error {
	switch {
	case ch.Old == nil:
		log.L.WithFields(fields(*ch.New)).Info("container added")
	case ch.New == nil:
		log.L.WithFields(fields(*ch.Old)).Info("container deleted")
		n.mu.Lock()
		n.deleted = append([]tombstone{{*ch.Old, time.Now()}}, n.deleted[:min(len(n.deleted), keepDeleted-1)]...)
		n.mu.Unlock()
	default:
		_, was := shownTask(*ch.Old)
		log.L.WithFields(fields(*ch.New)).WithField("was", was).Info("container updated")
	}
	return nil // an error here would have the change delivered again, with backoff
}

// imageChanged logs a change; a tombstone still has the digest its name
// pointed at.
func (n *node) imageChanged(_ context.Context, ch containerd.Change[containerd.Image]) error {
	switch {
	case ch.Old == nil:
		log.L.WithField("name", ch.New.Name).WithField("target", ch.New.Target).Info("image added")
	case ch.New == nil:
		log.L.WithField("name", ch.Old.Name).WithField("target", ch.Old.Target).Info("image deleted")
	default:
		log.L.WithField("name", ch.New.Name).WithField("target", ch.New.Target).Info("image updated")
	}
	return nil
}

// fields are what a log line says of c.
func fields(c containerd.Container) log.Fields {
	t, status := shownTask(c)
	f := log.Fields{"id": c.ID, "image": c.Image, "task": status}
	if t == nil {
		return f
	}
	f["pid"] = t.Pid
	if t.Status == containerd.TaskStopped {
		f["exit"] = exitOf(t)
	}
	if t.OOMKilled {
		f["oom"] = true // from the stream's TaskOOM: no listing says it
	}
	return f
}

// shownTask is the task to show for c, with its status: the current one,
// or, once it was deleted, the last one's final state.
func shownTask(c containerd.Container) (*containerd.Task, string) {
	switch {
	case c.Task != nil:
		return c.Task, string(c.Task.Status)
	case c.LastExit != nil:
		return c.LastExit, "task deleted"
	}
	return nil, "none"
}

// exitOf describes a stopped task's end. The informer reports an exit it
// could not learn as UnknownExitCode with no exit time.
func exitOf(t *containerd.Task) string {
	if t.Status != containerd.TaskStopped {
		return ""
	}
	s := strconv.FormatUint(uint64(t.ExitStatus), 10)
	if t.ExitStatus == eventmonitor.UnknownExitCode && t.ExitedAt.IsZero() {
		s = "unknown"
	}
	if t.OOMKilled {
		s += " (OOM)"
	}
	return s
}

// row is a container as the page shows it.
type row struct{ ID, Image, Task, Pid, Exit, Age string }

func rowOf(c containerd.Container, since time.Time) row {
	r := row{ID: c.ID, Image: c.Image}
	t, status := shownTask(c)
	r.Task = status
	if t != nil {
		r.Pid, r.Exit = strconv.FormatUint(uint64(t.Pid), 10), exitOf(t)
	}
	if !since.IsZero() {
		r.Age = time.Since(since).Round(time.Second).String()
	}
	return r
}

var page = template.Must(template.New("page").Parse(`<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="2">
<title>nodewatch: {{.Namespace}}</title>
<style>body{font-family:sans-serif} th,td{text-align:left;padding:2px 12px} .stopped,.deleted{color:#a00}</style>
</head><body>
<h1>Namespace {{.Namespace}} on {{.Address}}</h1>
{{if not .Synced}}<p>Listing&hellip;</p>{{end}}
<h2>Containers ({{len .Containers}})</h2>
<table><tr><th>ID</th><th>Image</th><th>Task</th><th>PID</th><th>Exit</th><th>Age</th></tr>
{{range .Containers}}<tr class="{{.Task}}"><td>{{.ID}}</td><td>{{.Image}}</td><td>{{.Task}}</td><td>{{.Pid}}</td><td>{{.Exit}}</td><td>{{.Age}}</td></tr>
{{end}}</table>
<h2>Recently deleted</h2>
<table><tr><th>ID</th><th>Image</th><th>Task</th><th>PID</th><th>Exit</th><th>Deleted</th></tr>
{{range .Deleted}}<tr><td>{{.ID}}</td><td>{{.Image}}</td><td>{{.Task}}</td><td>{{.Pid}}</td><td>{{.Exit}}</td><td>{{.Age}} ago</td></tr>
{{end}}</table>
<h2>Images ({{len .Images}})</h2>
<table><tr><th>Name</th><th>Target</th></tr>
{{range .Images}}<tr><td>{{.Name}}</td><td>{{.Target}}</td></tr>
{{end}}</table>
</body></html>
`))

func (n *node) servePage(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/" {
		http.NotFound(w, r)
		return
	}
	data := struct {
		Namespace, Address  string
		Synced              bool
		Containers, Deleted []row
		Images              []containerd.Image
	}{Namespace: n.namespace, Address: n.address, Synced: n.containers.HasSynced() && n.images.HasSynced(),
		Images: n.images.List()}
	for _, c := range n.containers.List() {
		data.Containers = append(data.Containers, rowOf(c, c.CreatedAt))
	}
	n.mu.Lock()
	for _, d := range n.deleted {
		data.Deleted = append(data.Deleted, rowOf(d.container, d.at))
	}
	n.mu.Unlock()
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	if err := page.Execute(w, data); err != nil {
		log.L.WithError(err).Warn("nodewatch: rendering the page")
	}
}
