// Package vllm is what the scheduler reads of vLLM and SGLang engines
// beside their OpenAI API (served by workers/httpengine): their load and KV
// capacity, scraped from the Prometheus text of /metrics. Their KV cache
// events are read by the subpackage kvevents.
package vllm
