package scheduler

import (
	"flag"
	"os"
	"reflect"
	"testing"

	"github.com/batonllm/baton/scheduler/internal/configdoc"
)

var updateReference = flag.Bool("update-config-reference", false, "rewrite docs/config-reference.md from the Config declarations")

const referenceHeader = `# Configuration reference

Every key of ` + "`baton serve --config FILE`" + `, with its type and what its field's doc comment says.
This page is generated from the declarations of ` + "`scheduler.Config`" + ` and the types it holds; a test
fails when they drift. To regenerate it:

` + "```sh\ngo test ./scheduler -run TestConfigReference -update-config-reference\n```" + `

Durations are written as Go durations (` + "`250ms`, `2s`, `10m`" + `); ` + "`workers[].`" + ` keys belong to each
item of the ` + "`workers`" + ` list. An absent or zero value means the default the text gives. Examples and
how the settings fit together: [configuration.md](configuration.md).

`

// TestConfigReference: docs/config-reference.md is what the Config
// declarations and their doc comments say.
func TestConfigReference(t *testing.T) {
	ref, err := configdoc.Reference(reflect.TypeFor[Config](), "github.com/batonllm/baton", "..")
	if err != nil {
		t.Fatal(err)
	}
	want := referenceHeader + ref
	const path = "../docs/config-reference.md"
	if *updateReference {
		if err := os.WriteFile(path, []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != want {
		t.Errorf("%s is not what the Config declarations say: run  go test ./scheduler -run TestConfigReference -update-config-reference", path)
	}
}
