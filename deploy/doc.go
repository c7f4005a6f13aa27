// Package deploy holds baton's Kubernetes manifests. Its tests build every
// kustomization with kustomize's own library, as `kubectl apply -k` does,
// decode the output strictly into the Kubernetes API types, and check the
// objects against each other and against baton.
package deploy
