package httpengine

import (
	"context"
	"errors"
	"io"
	"net/http"
	"testing"

	"github.com/batonllm/baton/workers/engine"
)

// vLLM's answers to adapter loads and unloads, as its serving layer
// gives them (status, body), and what each call returns.
func TestAdapterCalls(t *testing.T) {
	for _, tt := range []struct {
		name         string
		unload       bool
		status       int
		answer, want string
		ok           bool
	}{
		{"loaded", false, 200, "Success: LoRA adapter 'sql' added successfully.", `{"lora_name":"sql","lora_path":"/a/sql"}`, true},
		{"already loaded", false, 400, `{"object":"error","message":"The lora adapter 'sql' has already been loaded.","type":"InvalidUserInput","code":400}`, `{"lora_name":"sql","lora_path":"/a/sql"}`, true},
		{"bad path", false, 400, `{"object":"error","message":"No adapter found for /a/sql","type":"BadRequestError","code":400}`, `{"lora_name":"sql","lora_path":"/a/sql"}`, false},
		{"engine failed", false, 500, `internal error`, `{"lora_name":"sql","lora_path":"/a/sql"}`, false},
		{"unloaded", true, 200, "Success: LoRA adapter 'sql' removed successfully.", `{"lora_name":"sql"}`, true},
		{"not loaded", true, 404, `{"object":"error","message":"The lora adapter 'sql' cannot be found.","type":"NotFoundError","code":404}`, `{"lora_name":"sql"}`, true},
		{"unload failed", true, 500, `internal error`, `{"lora_name":"sql"}`, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var path, body string
			c := startEngine(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				b, _ := io.ReadAll(r.Body)
				path, body = r.URL.Path, string(b)
				w.WriteHeader(tt.status)
				io.WriteString(w, tt.answer)
			}))
			var err error
			wantPath := LoadAdapterPath
			if tt.unload {
				wantPath = UnloadAdapterPath
				err = c.UnloadAdapter(context.Background(), "sql")
			} else {
				err = c.LoadAdapter(context.Background(), engine.Adapter{Name: "sql", Base: "llama", Source: "/a/sql"})
			}
			if path != wantPath || body != tt.want {
				t.Errorf("engine got %s %s, want %s %s", path, body, wantPath, tt.want)
			}
			if (err == nil) != tt.ok {
				t.Errorf("error = %v, want ok=%t", err, tt.ok)
			}
			var se *StatusError
			if err != nil && !errors.As(err, &se) {
				t.Errorf("error %v is no *StatusError", err)
			}
		})
	}
}
