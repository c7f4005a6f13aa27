package openai

import (
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/batonllm/baton/workers/engine"
)

// DefaultMaxBodyBytes is the default request body limit: 6 MiB, as
// SageMaker's invocation payload limit.
const DefaultMaxBodyBytes = 6 << 20

// ReadBody reads r's body, at most limit bytes, decoding a gzip
// Content-Encoding (the decoded body is held to limit too). A larger body
// is a 413 *Error, another encoding a 415.
func ReadBody(w http.ResponseWriter, r *http.Request, limit int64) ([]byte, error) {
	if r.ContentLength > limit {
		return nil, TooLarge(limit)
	}
	var body io.Reader = http.MaxBytesReader(w, r.Body, limit)
	var b []byte
	switch enc := strings.ToLower(strings.TrimSpace(r.Header.Get("Content-Encoding"))); enc {
	case "", "identity":
		if r.ContentLength > 0 {
			// Sized at once: growing from io.ReadAll's 512 bytes copies
			// a long prompt several times.
			b = make([]byte, 0, r.ContentLength+1)
		}
	case "gzip":
		zr, err := gzip.NewReader(body)
		if err != nil {
			return nil, readError(w, err)
		}
		defer zr.Close()
		body = io.LimitReader(zr, limit+1)
	default:
		w.Header().Set("Connection", "close")
		return nil, &Error{Status: http.StatusUnsupportedMediaType, Type: TypeInvalidRequest, Code: "unsupported_encoding",
			Message: "Content-Encoding " + strconv.Quote(enc) + " is not supported; send gzip or no encoding"}
	}
	b, err := readAll(body, b)
	if err != nil {
		return nil, readError(w, err)
	}
	if int64(len(b)) > limit {
		return nil, TooLarge(limit)
	}
	return b, nil
}

// readAll is io.ReadAll appending to b.
func readAll(r io.Reader, b []byte) ([]byte, error) {
	for {
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)]
		}
		n, err := r.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if err == io.EOF {
			return b, nil
		}
		if err != nil {
			return b, err
		}
	}
}

// readError turns an error reading a body into the client's error.
func readError(w http.ResponseWriter, err error) error {
	var mbe *http.MaxBytesError
	if errors.As(err, &mbe) {
		return TooLarge(mbe.Limit)
	}
	// The rest of the body will not be read: the connection cannot carry
	// another request (and net/http would otherwise try to drain the body
	// before answering).
	w.Header().Set("Connection", "close")
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return &Error{Status: http.StatusRequestTimeout, Type: TypeInvalidRequest, Code: "request_timeout",
			Message: "the request body did not arrive in time"}
	}
	return Invalid("", "invalid_body", "reading the request body: "+err.Error())
}

// WriteModels writes the /v1/models list.
func WriteModels(w http.ResponseWriter, models []string, created int64) {
	WriteModelList(w, models, nil, created)
}

// WriteModelList writes the /v1/models list, each model with its parent
// when parents has one: a LoRA adapter's base model, as vLLM lists them.
func WriteModelList(w http.ResponseWriter, models []string, parents map[string]string, created int64) {
	type model struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		Created int64  `json:"created"`
		OwnedBy string `json:"owned_by"`
		Parent  string `json:"parent,omitempty"`
	}
	list := struct {
		Object string  `json:"object"`
		Data   []model `json:"data"`
	}{Object: "list", Data: []model{}}
	for _, m := range models {
		list.Data = append(list.Data, model{ID: m, Object: "model", Created: created, OwnedBy: "baton", Parent: parents[m]})
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(list)
}

// Generator starts one generation; engines and engine clients provide it.
type Generator func(ctx context.Context, req *engine.Request) (engine.Stream, error)

// Server serves the OpenAI API in front of one engine: chat and text
// completions, /v1/models and /health (vLLM's health route). It lets a
// simulated worker stand in for vLLM behind any OpenAI-speaking router.
type Server struct {
	models  []string
	gen     Generator
	maxBody int64
	log     *slog.Logger
	created int64
	mux     *http.ServeMux
}

// NewServer returns a Server for models backed by gen. maxBody ≤ 0 means
// DefaultMaxBodyBytes; a nil log discards.
func NewServer(models []string, gen Generator, maxBody int64, log *slog.Logger) *Server {
	if maxBody <= 0 {
		maxBody = DefaultMaxBodyBytes
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{models: models, gen: gen, maxBody: maxBody, log: log, created: time.Now().Unix(), mux: http.NewServeMux()}
	s.mux.HandleFunc("POST "+ChatPath, func(w http.ResponseWriter, r *http.Request) { s.generate(w, r, Chat) })
	s.mux.HandleFunc("POST "+CompletionPath, func(w http.ResponseWriter, r *http.Request) { s.generate(w, r, Completion) })
	s.mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, r *http.Request) { WriteModels(w, s.models, s.created) })
	s.mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) })
	return s
}

func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.mux.ServeHTTP(w, r) }

func (s *Server) generate(w http.ResponseWriter, r *http.Request, k Kind) {
	body, err := ReadBody(w, r, s.maxBody)
	if err != nil {
		WriteError(w, err)
		return
	}
	req, err := Parse(k, body)
	if err != nil {
		WriteError(w, err)
		return
	}
	if !slices.Contains(s.models, req.Model) {
		WriteError(w, ModelNotFound(req.Model))
		return
	}
	if t := r.Header.Get("X-Prefix-Aware-Id"); t != "" && req.Tenant == "" {
		if err := ValidTenant(t); err != nil {
			WriteError(w, Invalid("X-Prefix-Aware-Id", "invalid_value", "X-Prefix-Aware-Id "+err.Error()))
			return
		}
		req.Tenant = t
	}
	ctx := r.Context()
	stream, err := s.gen(ctx, &req.Request)
	if err != nil {
		WriteError(w, engineError(ctx, err))
		return
	}
	defer stream.Close()
	if _, written, err := Write(w, req, NewID(k), stream, nil); err != nil {
		if !written {
			WriteError(w, engineError(ctx, err))
		}
		s.log.Debug("generation ended early", "err", err)
	}
}

// engineError maps a generation error to the API error the client sees.
func engineError(ctx context.Context, err error) *Error {
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return Timeout()
	case errors.Is(err, engine.ErrUnavailable):
		return NoWorker("the engine is unavailable: " + err.Error())
	case ctx.Err() != nil:
		// The client went away; nobody reads this.
		return Internal(499, "client closed request")
	}
	var e *Error
	if errors.As(err, &e) {
		return e
	}
	return Internal(http.StatusInternalServerError, err.Error())
}
