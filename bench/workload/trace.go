package workload

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"
)

// MooncakeRecord is one line of a Mooncake trace.
type MooncakeRecord struct {
	Timestamp    int64    `json:"timestamp"` // ms from the trace's start
	InputLength  int      `json:"input_length"`
	OutputLength int      `json:"output_length"`
	HashIDs      []uint64 `json:"hash_ids"`
}

// MooncakeBlockTokens is the size of the block one Mooncake hash id stands for.
const MooncakeBlockTokens = 512

// ParseMooncake reads a Mooncake JSONL trace, at most limit records (0: all).
// A malformed line is an error naming its line number.
func ParseMooncake(r io.Reader, limit int) ([]MooncakeRecord, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	var out []MooncakeRecord
	line := 0
	for sc.Scan() {
		line++
		b := bytes.TrimSpace(sc.Bytes())
		if len(b) == 0 {
			continue
		}
		var rec MooncakeRecord
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&rec); err != nil {
			return nil, fmt.Errorf("mooncake trace line %d: %v", line, err)
		}
		switch {
		case rec.Timestamp < 0:
			return nil, fmt.Errorf("mooncake trace line %d: negative timestamp %d", line, rec.Timestamp)
		case rec.InputLength < 1:
			return nil, fmt.Errorf("mooncake trace line %d: input_length %d is below 1", line, rec.InputLength)
		case rec.OutputLength < 1:
			return nil, fmt.Errorf("mooncake trace line %d: output_length %d is below 1", line, rec.OutputLength)
		case len(rec.HashIDs) != (rec.InputLength+MooncakeBlockTokens-1)/MooncakeBlockTokens:
			return nil, fmt.Errorf("mooncake trace line %d: %d hash_ids for input_length %d (want ceil(%d/512) = %d)",
				line, len(rec.HashIDs), rec.InputLength, rec.InputLength, (rec.InputLength+MooncakeBlockTokens-1)/MooncakeBlockTokens)
		case len(out) > 0 && rec.Timestamp < out[len(out)-1].Timestamp:
			return nil, fmt.Errorf("mooncake trace line %d: timestamp %d goes back in time", line, rec.Timestamp)
		}
		out = append(out, rec)
		if limit > 0 && len(out) == limit {
			return out, nil
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("mooncake trace line %d: %v", line+1, err)
	}
	return out, nil
}

// mooncakeBlock returns the deterministic 2,048-character text of hash id
// h: equal ids give byte-identical blocks, so shared leading ids give
// byte-identical prefixes.
func mooncakeBlock(seed, h uint64) string {
	head := fmt.Sprintf("[block %d] ", h)
	return head + Text(rngFor(seed, 1<<40+h), MooncakeBlockTokens*CharsPerToken-len(head))
}

// Mooncake turns trace records into requests: each hash id becomes its own
// 512-token block of text, the prompt is their concatenation cut to
// input_length tokens, max_tokens is output_length, arrivals are the
// trace's timestamps. Its description calls the records the Mooncake
// conversation trace; MooncakeFile names another trace's file.
func Mooncake(recs []MooncakeRecord, seed uint64) *Workload {
	return mooncake(recs, seed, "Mooncake conversation trace")
}

// MooncakeFile is Mooncake of records read from the file called name,
// which its description names.
func MooncakeFile(recs []MooncakeRecord, seed uint64, name string) *Workload {
	return mooncake(recs, seed, "Mooncake-format trace "+name)
}

func mooncake(recs []MooncakeRecord, seed uint64, title string) *Workload {
	blocks := map[uint64]string{}
	w := &Workload{Name: "mooncake", Timed: true, Requests: make([]Request, len(recs))}
	var b strings.Builder
	for i, rec := range recs {
		b.Reset()
		for _, h := range rec.HashIDs {
			s, ok := blocks[h]
			if !ok {
				s = mooncakeBlock(seed, h)
				blocks[h] = s
			}
			b.WriteString(s)
		}
		p := b.String()[:rec.InputLength*CharsPerToken]
		w.Requests[i] = Request{At: time.Duration(rec.Timestamp) * time.Millisecond,
			Messages: []Message{{Role: "user", Content: p}}, MaxTokens: rec.OutputLength}
	}
	var span time.Duration
	if len(recs) > 0 {
		span = w.Requests[len(recs)-1].At
	}
	w.Describe = fmt.Sprintf("%s, first %d records over %.0f s of trace time, %d distinct 512-token blocks", title, len(recs), span.Seconds(), len(blocks))
	return w
}

// AzureRecord is one row of an Azure LLM inference trace.
type AzureRecord struct {
	Time            time.Time
	ContextTokens   int
	GeneratedTokens int
}

const azureTime = "2006-01-02 15:04:05.9999999"

// ParseAzure reads an Azure CSV trace (TIMESTAMP,ContextTokens,
// GeneratedTokens), at most limit records (0: all). A malformed line is an
// error naming its line number.
func ParseAzure(r io.Reader, limit int) ([]AzureRecord, error) {
	sc := bufio.NewScanner(r)
	var out []AzureRecord
	line := 0
	for sc.Scan() {
		line++
		s := strings.TrimSpace(sc.Text())
		if line == 1 {
			if s != "TIMESTAMP,ContextTokens,GeneratedTokens" {
				return nil, fmt.Errorf("azure trace line 1: header %q, want TIMESTAMP,ContextTokens,GeneratedTokens", s)
			}
			continue
		}
		if s == "" {
			continue
		}
		f := strings.Split(s, ",")
		if len(f) != 3 {
			return nil, fmt.Errorf("azure trace line %d: %d fields, want 3", line, len(f))
		}
		t, err := time.Parse(azureTime, f[0])
		if err != nil {
			return nil, fmt.Errorf("azure trace line %d: timestamp: %v", line, err)
		}
		ctx, err := strconv.Atoi(f[1])
		if err != nil || ctx < 1 {
			return nil, fmt.Errorf("azure trace line %d: ContextTokens %q is not a positive integer", line, f[1])
		}
		gen, err := strconv.Atoi(f[2])
		if err != nil || gen < 1 {
			return nil, fmt.Errorf("azure trace line %d: GeneratedTokens %q is not a positive integer", line, f[2])
		}
		if len(out) > 0 && t.Before(out[len(out)-1].Time) {
			return nil, fmt.Errorf("azure trace line %d: timestamp goes back in time", line)
		}
		out = append(out, AzureRecord{Time: t, ContextTokens: ctx, GeneratedTokens: gen})
		if limit > 0 && len(out) == limit {
			break
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("azure trace line %d: %v", line+1, err)
	}
	if line == 0 {
		return nil, fmt.Errorf("azure trace line 1: empty file")
	}
	return out, nil
}

// Azure turns Azure trace rows into requests with unique text (the trace
// carries no prefix information), the trace's arrival times and lengths.
// Its description calls the rows the Azure trace; AzureFile names another
// trace's file.
func Azure(recs []AzureRecord, seed uint64) *Workload { return azure(recs, seed, "Azure trace") }

// AzureFile is Azure of rows read from the file called name, which its
// description names.
func AzureFile(recs []AzureRecord, seed uint64, name string) *Workload {
	return azure(recs, seed, "Azure-format trace "+name)
}

func azure(recs []AzureRecord, seed uint64, title string) *Workload {
	w := &Workload{Name: "azure", Timed: true, Requests: make([]Request, len(recs))}
	for i, rec := range recs {
		head := fmt.Sprintf("Request %d. ", i)
		w.Requests[i] = Request{At: rec.Time.Sub(recs[0].Time),
			Messages:  []Message{{Role: "user", Content: head + Text(rngFor(seed, 1<<41+uint64(i)), max(rec.ContextTokens*CharsPerToken-len(head), 1))}},
			MaxTokens: rec.GeneratedTokens}
	}
	var span time.Duration
	if len(recs) > 0 {
		span = w.Requests[len(recs)-1].At
	}
	w.Describe = fmt.Sprintf("%s, first %d rows over %.0f s of trace time, no prefix sharing", title, len(recs), span.Seconds())
	return w
}

// LoadTrace parses the trace file at path with parse.
func LoadTrace[T any](path string, limit int, parse func(io.Reader, int) ([]T, error)) ([]T, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	recs, err := parse(f, limit)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return recs, nil
}
