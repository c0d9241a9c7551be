package prometheus_test

import (
	"context"
	"fmt"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/eventmonitor/eventmonitor"
	emprom "github.com/eventmonitor/eventmonitor/prometheus"
)

// A Collector is both the monitor's Metrics and a prometheus.Collector that
// reads the monitor's Stats when scraped.
func ExampleNew() {
	collector := emprom.New(emprom.WithSubsystem("cri"))
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(context.Context, any) error { return nil }),
		eventmonitor.WithMetrics(collector))
	if err != nil {
		panic(err)
	}
	defer m.Stop()
	collector.Watch(m)

	registry := prometheus.NewRegistry()
	registry.MustRegister(collector)
	http.Handle("/metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{}))

	families, _ := registry.Gather()
	fmt.Println(len(families), "metric families, the first:", families[0].GetName())
	// Output: 16 metric families, the first: eventmonitor_cri_events_dropped_total
}
