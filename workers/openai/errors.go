// Package openai speaks the OpenAI HTTP API on baton's behalf: it parses and
// validates chat and completion requests into engine.Requests, renders
// engine event streams as OpenAI responses (JSON or server-sent events) and
// writes errors in OpenAI's shape. The scheduler's front end and the
// simulated worker's own HTTP endpoint both use it.
package openai

import (
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
)

// Error is an API error in OpenAI's shape:
//
//	{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
//
// Status is the HTTP status it is sent with.
type Error struct {
	Status  int
	Message string
	Type    string
	Param   string
	Code    string
	// RetryAfter, if positive, is sent as the Retry-After header (seconds).
	RetryAfter int
}

func (e *Error) Error() string { return e.Message }

// Error types, as OpenAI names them.
const (
	TypeInvalidRequest = "invalid_request_error"
	TypeNotFound       = "not_found_error"
	TypeServer         = "server_error"
	TypeOverloaded     = "overloaded_error"
	TypeTimeout        = "timeout_error"
)

// Invalid returns a 400 naming the offending parameter.
func Invalid(param, code, msg string) *Error {
	return &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Param: param, Code: code, Message: msg}
}

// ModelNotFound returns the 404 for a model no worker serves.
func ModelNotFound(model string) *Error {
	return &Error{
		Status: http.StatusNotFound, Type: TypeInvalidRequest, Param: "model", Code: "model_not_found",
		Message: "The model `" + model + "` does not exist or is not served here.",
	}
}

// TooLarge returns the 413 for a body over limit bytes.
func TooLarge(limit int64) *Error {
	return &Error{
		Status: http.StatusRequestEntityTooLarge, Type: TypeInvalidRequest, Code: "request_too_large",
		Message: "Request body is larger than the limit of " + strconv.FormatInt(limit, 10) + " bytes.",
	}
}

// NoWorker returns the 503 sent when no worker can take the request.
func NoWorker(msg string) *Error {
	return &Error{Status: http.StatusServiceUnavailable, Type: TypeServer, Code: "no_worker_available", Message: msg, RetryAfter: 1}
}

// Timeout returns the 504 sent when the request's deadline passed.
func Timeout() *Error {
	return &Error{Status: http.StatusGatewayTimeout, Type: TypeTimeout, Code: "deadline_exceeded", Message: "The request did not complete within its deadline."}
}

// Internal returns a 500 (or the given status) for a failure on baton's side.
func Internal(status int, msg string) *Error {
	return &Error{Status: status, Type: TypeServer, Code: "internal_error", Message: msg}
}

type errorBody struct {
	Error errorFields `json:"error"`
}

type errorFields struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

func (e *Error) body() errorBody {
	f := errorFields{Message: e.Message, Type: e.Type}
	if e.Param != "" {
		f.Param = &e.Param
	}
	if e.Code != "" {
		f.Code = &e.Code
	}
	return errorBody{Error: f}
}

// MarshalJSON renders the error in OpenAI's shape.
func (e *Error) MarshalJSON() ([]byte, error) { return json.Marshal(e.body()) }

// WriteError writes err in OpenAI's shape. An error that is not an *Error
// is sent as a 500 with its message.
func WriteError(w http.ResponseWriter, err error) {
	var e *Error
	if !errors.As(err, &e) {
		e = Internal(http.StatusInternalServerError, err.Error())
	}
	h := w.Header()
	h.Set("Content-Type", "application/json")
	if e.RetryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(e.RetryAfter))
	}
	w.WriteHeader(e.Status)
	b, _ := json.Marshal(e.body())
	w.Write(append(b, '\n'))
}
