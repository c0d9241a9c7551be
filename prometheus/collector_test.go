package prometheus_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/typeurl/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/eventmonitor/eventmonitor"
	emprom "github.com/eventmonitor/eventmonitor/prometheus"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// scrape fetches url over HTTP and parses the text exposition.
func scrape(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	require.NoError(t, err)
	return families
}

// series returns the first series of family name whose labels include the
// given name and value (any series when no label is given).
func series(t *testing.T, families map[string]*dto.MetricFamily, name string, label ...string) *dto.Metric {
	t.Helper()
	f, ok := families[name]
	require.True(t, ok, "metric %s not scraped", name)
	for _, m := range f.GetMetric() {
		if len(label) == 2 && !hasLabel(m, label[0], label[1]) {
			continue
		}
		return m
	}
	t.Fatalf("no series of %s %v", name, label)
	return nil
}

// value returns a counter's or gauge's sample.
func value(t *testing.T, families map[string]*dto.MetricFamily, name string, label ...string) float64 {
	t.Helper()
	m := series(t, families, name, label...)
	if m.Counter != nil {
		return m.Counter.GetValue()
	}
	require.NotNil(t, m.Gauge, "%s is neither a counter nor a gauge", name)
	return m.Gauge.GetValue()
}

func histogram(t *testing.T, families map[string]*dto.MetricFamily, name string, label ...string) *dto.Histogram {
	t.Helper()
	h := series(t, families, name, label...).GetHistogram()
	require.NotNil(t, h, "%s is not a histogram", name)
	return h
}

func hasLabel(m *dto.Metric, name, value string) bool {
	for _, l := range m.GetLabel() {
		if l.GetName() == name && l.GetValue() == value {
			return true
		}
	}
	return false
}

// waitFor polls cond until it holds or a deadline passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// checkMatchesStats asserts that every counter and gauge scraped equals the
// Stats snapshot and that the backoff gauges agree with Pending.
func checkMatchesStats(t *testing.T, families map[string]*dto.MetricFamily, s eventmonitor.Stats, pending []eventmonitor.Pending) {
	t.Helper()
	for name, want := range map[string]float64{
		"eventmonitor_events_received_total":        float64(s.Received),
		"eventmonitor_events_filtered_total":        float64(s.Filtered),
		"eventmonitor_events_ignored_total":         float64(s.Ignored),
		"eventmonitor_events_handled_total":         float64(s.Handled),
		"eventmonitor_events_failed_total":          float64(s.Failed),
		"eventmonitor_retries_total":                float64(s.Retried),
		"eventmonitor_events_forgotten_total":       float64(s.Forgotten),
		"eventmonitor_stream_resubscriptions_total": float64(s.Resubscribed),
		"eventmonitor_handlers_in_flight":           float64(s.InFlight),
		"eventmonitor_handlers_overrunning":         float64(s.Overrunning),
		"eventmonitor_events_queued":                float64(s.Queued),
		"eventmonitor_keys_in_backoff":              float64(s.KeysInBackoff),
		"eventmonitor_events_in_backoff":            float64(s.EventsInBackoff),
	} {
		assert.Equal(t, want, value(t, families, name), name)
	}
	var dropped float64
	for _, m := range families["eventmonitor_events_dropped_total"].GetMetric() {
		dropped += m.GetCounter().GetValue()
	}
	assert.Equal(t, float64(s.Dropped), dropped, "dropped over all reasons")
	calls := histogram(t, families, "eventmonitor_handler_duration_seconds", "result", "success").GetSampleCount() +
		histogram(t, families, "eventmonitor_handler_duration_seconds", "result", "error").GetSampleCount()
	assert.Equal(t, s.Handled+s.Failed, calls, "handler duration observations")

	events := 0
	for _, p := range pending {
		events += len(p.Events)
	}
	assert.Len(t, pending, s.KeysInBackoff, "keys in Pending")
	assert.Equal(t, s.EventsInBackoff, events, "events in Pending")
}

// TestScrapeMatchesStats serves the collector on a loopback HTTP endpoint
// and checks what a scrape reads against Stats and Pending, before and
// after a backoff replay in which one key recovers and one is given up.
func TestScrapeMatchesStats(t *testing.T) {
	clock := clocktesting.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	var mu sync.Mutex
	calls := map[string]int{}
	handler := eventmonitor.HandlerFunc(func(_ context.Context, event any) error {
		key := event.(string)
		mu.Lock()
		calls[key]++
		n := calls[key]
		mu.Unlock()
		switch {
		case key == "flaky" && n == 1, strings.HasPrefix(key, "stuck"):
			return errors.New("runtime not ready")
		}
		return nil
	})
	collector := emprom.New()
	m, err := eventmonitor.New(handler,
		eventmonitor.WithClock(clock),
		eventmonitor.WithWorkers(2),
		eventmonitor.WithBackoff(time.Second, 10*time.Second),
		eventmonitor.WithMaxAttempts(2),
		eventmonitor.WithMetrics(collector),
		eventmonitor.WithDropHandler(func(eventmonitor.Drop) {}),
	)
	require.NoError(t, err)
	defer m.Stop()
	collector.Watch(m)

	registry := prometheus.NewRegistry()
	require.NoError(t, registry.Register(collector))
	server := httptest.NewServer(promhttp.HandlerFor(registry, promhttp.HandlerOpts{}))
	defer server.Close()

	for _, key := range []string{"a", "b", "c", "flaky", "stuck"} {
		require.NoError(t, m.Submit(key, key))
	}
	waitFor(t, "first calls", func() bool { s := m.Stats(); return s.Handled == 3 && s.KeysInBackoff == 2 })
	first := scrape(t, server.URL)
	checkMatchesStats(t, first, m.Stats(), m.Pending())
	assert.Equal(t, 2.0, value(t, first, "eventmonitor_keys_in_backoff"))

	clock.Step(time.Second)
	waitFor(t, "replay", func() bool { s := m.Stats(); return s.Handled == 4 && s.Dropped == 1 && s.KeysInBackoff == 0 })
	// Another failing key, so that something is in backoff at the second scrape.
	require.NoError(t, m.Submit("stuck-later", "stuck-later"))
	waitFor(t, "new key in backoff", func() bool { return m.Stats().KeysInBackoff == 1 })
	second := scrape(t, server.URL)
	checkMatchesStats(t, second, m.Stats(), m.Pending())
	assert.Equal(t, 1.0, value(t, second, "eventmonitor_events_dropped_total", "reason", emprom.ReasonMaxAttempts))
	assert.Equal(t, 0.0, value(t, second, "eventmonitor_events_dropped_total", "reason", emprom.ReasonStopped))
	recovery := histogram(t, second, "eventmonitor_recovery_duration_seconds")
	assert.Equal(t, uint64(1), recovery.GetSampleCount(), "one event recovered")
	assert.Equal(t, 1.0, recovery.GetSampleSum(), "it recovered one backoff delay after failing")
}

// payload is an envelope's payload of any type URL.
type payload string

func (p payload) GetTypeUrl() string { return string(p) }
func (p payload) GetValue() []byte   { return nil }

// TestIgnoredAndOverrunning scrapes the two figures that say the monitor is
// not handling something: envelopes of types it has no key for, and calls
// stuck past their timeout.
func TestIgnoredAndOverrunning(t *testing.T) {
	clock := clocktesting.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	release := make(chan struct{})
	collector := emprom.New()
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(context.Context, any) error {
		<-release // ignores its context
		return nil
	}),
		eventmonitor.WithClock(clock),
		eventmonitor.WithHandleTimeout(time.Second),
		eventmonitor.WithMetrics(collector),
		eventmonitor.WithConverter(eventmonitor.ConverterFunc(func(p typeurl.Any) (string, any, error) {
			return "", nil, fmt.Errorf("%w: %s", eventmonitor.ErrUnsupportedEvent, p.GetTypeUrl())
		})),
	)
	require.NoError(t, err)
	defer m.Stop()
	defer close(release)
	collector.Watch(m)
	registry := prometheus.NewRegistry()
	require.NoError(t, registry.Register(collector))
	server := httptest.NewServer(promhttp.HandlerFor(registry, promhttp.HandlerOpts{}))
	defer server.Close()

	envelopes := make(chan *eventmonitor.Envelope, 2)
	envelopes <- &eventmonitor.Envelope{Topic: "/images/create", Event: payload("containerd.events.ImageCreate")}
	envelopes <- &eventmonitor.Envelope{Topic: "/images/create", Event: payload("containerd.events.ImageCreate")}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go m.Run(ctx, eventmonitor.SubscriberFunc(func(context.Context, ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
		return envelopes, nil
	}))
	require.NoError(t, m.Submit("hung", "event"))
	waitFor(t, "the call and the ignored envelopes", func() bool { s := m.Stats(); return s.InFlight == 1 && s.Ignored == 2 })
	clock.Step(time.Second + 100*time.Millisecond) // the deadline, then the grace of min(1 s, timeout/10)
	waitFor(t, "the overrun", func() bool { return m.Stats().Overrunning == 1 })

	families := scrape(t, server.URL)
	checkMatchesStats(t, families, m.Stats(), m.Pending())
	assert.Equal(t, 2.0, value(t, families, "eventmonitor_events_ignored_total"))
	assert.Equal(t, 1.0, value(t, families, "eventmonitor_handlers_overrunning"))
	var dropped float64
	for _, m := range families["eventmonitor_events_dropped_total"].GetMetric() {
		dropped += m.GetCounter().GetValue()
	}
	assert.Zero(t, dropped, "ignored envelopes are not drops")
}

func TestOptionsNameMetrics(t *testing.T) {
	collector := emprom.New(emprom.WithNamespace("cri"), emprom.WithSubsystem("events"),
		emprom.WithConstLabels(prometheus.Labels{"runtime": "runc"}))
	registry := prometheus.NewRegistry()
	require.NoError(t, registry.Register(collector))
	families, err := registry.Gather()
	require.NoError(t, err)
	var names []string
	for _, f := range families {
		names = append(names, f.GetName())
		for _, m := range f.GetMetric() {
			assert.True(t, hasLabel(m, "runtime", "runc"), "const label on %s", f.GetName())
		}
	}
	// Without a watched monitor only what the Metrics methods record is there.
	assert.ElementsMatch(t, []string{
		"cri_events_handler_duration_seconds",
		"cri_events_recovery_duration_seconds",
		"cri_events_events_dropped_total",
	}, names)
}

func TestReason(t *testing.T) {
	for err, want := range map[error]string{
		eventmonitor.ErrStopped:                                  emprom.ReasonStopped,
		errors.Join(eventmonitor.ErrStopped, errors.New("boom")): emprom.ReasonStopped,
		eventmonitor.ErrMaxAttempts:                              emprom.ReasonMaxAttempts,
		eventmonitor.ErrQueueFull:                                emprom.ReasonQueueFull,
		eventmonitor.ErrDecode:                                   emprom.ReasonDecode,
		eventmonitor.ErrInvalidEvent:                             emprom.ReasonInvalid,
		errors.New("something else"):                             emprom.ReasonOther,
	} {
		assert.Equal(t, want, emprom.Reason(err), "%v", err)
	}
}
