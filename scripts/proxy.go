//go:build ignore

// Command proxy writes the repository's modules, at one version, as a file
// GOPROXY (https://go.dev/ref/mod#goproxy-protocol): what the module proxy
// would serve once that version is tagged. A consumer module built against
// it, with no replace directives, sees the modules as a user will.
//
//	go run scripts/proxy.go -version v0.1.0 -out /tmp/proxy
package main

import (
	"archive/zip"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

func main() {
	version := flag.String("version", "", "the version to serve every module at")
	out := flag.String("out", "", "the proxy directory to write")
	flag.Parse()
	if *version == "" || *out == "" {
		log.Fatal("usage: go run scripts/proxy.go -version vX.Y.Z -out DIR MODULE_DIR...")
	}
	for _, dir := range flag.Args() {
		if err := serve(dir, *version, *out); err != nil {
			log.Fatalf("%s: %v", dir, err)
		}
	}
}

func serve(dir, version, out string) error {
	gomod, err := os.ReadFile(filepath.Join(dir, "go.mod"))
	if err != nil {
		return err
	}
	path := modulePath(gomod)
	if path == "" {
		return fmt.Errorf("no module line in %s/go.mod", dir)
	}
	at := filepath.Join(out, path, "@v")
	if err := os.MkdirAll(at, 0o755); err != nil {
		return err
	}
	info, err := json.Marshal(map[string]any{"Version": version, "Time": time.Now().UTC()})
	if err != nil {
		return err
	}
	files := map[string][]byte{
		version + ".mod":  gomod,
		version + ".info": info,
		"list":            []byte(version + "\n"),
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(at, name), data, 0o644); err != nil {
			return err
		}
	}
	return zipModule(dir, path+"@"+version, filepath.Join(at, version+".zip"))
}

// zipModule zips the module in dir as a tag would hold it: the files git
// tracks under dir, but those of nested modules.
func zipModule(dir, prefix, zipPath string) error {
	listed, err := exec.Command("git", "-C", dir, "ls-files", "-z").Output()
	if err != nil {
		return fmt.Errorf("git ls-files: %w", err)
	}
	f, err := os.Create(zipPath)
	if err != nil {
		return err
	}
	defer f.Close()
	zw := zip.NewWriter(f)
	for _, rel := range strings.Split(strings.TrimRight(string(listed), "\x00"), "\x00") {
		if inNestedModule(dir, rel) {
			continue
		}
		data, err := os.ReadFile(filepath.Join(dir, rel))
		if err != nil {
			return err
		}
		w, err := zw.Create(prefix + "/" + rel)
		if err != nil {
			return err
		}
		if _, err := w.Write(data); err != nil {
			return err
		}
	}
	if err := zw.Close(); err != nil {
		return fmt.Errorf("zip: %w", err)
	}
	return f.Close()
}

// inNestedModule reports whether the file rel (relative to the module in
// dir) belongs to a module of its own in a subdirectory.
func inNestedModule(dir, rel string) bool {
	for sub := filepath.Dir(rel); sub != "."; sub = filepath.Dir(sub) {
		if _, err := os.Stat(filepath.Join(dir, sub, "go.mod")); err == nil {
			return true
		}
	}
	return false
}

// modulePath reads the module line of a go.mod; ours are plain, unquoted.
func modulePath(gomod []byte) string {
	for _, line := range strings.Split(string(gomod), "\n") {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "module "); ok {
			return strings.TrimSpace(rest)
		}
	}
	return ""
}
