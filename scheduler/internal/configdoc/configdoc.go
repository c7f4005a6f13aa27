// Package configdoc writes the reference of a configuration struct from
// its Go declaration: every YAML key it reads, nested keys under their
// parents, each with its type and the doc comment of its field, so that
// the reference says what the code says.
package configdoc

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"time"
)

// Reference returns the Markdown reference of root, a struct type whose
// fields carry yaml tags. Fields tagged "-" and unexported fields are
// left out; inline fields' keys are listed as their parent's. The doc
// comments are read from the Go files of each type's package, found
// under moduleDir by the package path's part after modulePath.
func Reference(root reflect.Type, modulePath, moduleDir string) (string, error) {
	g := &gen{modulePath: modulePath, moduleDir: moduleDir, docs: map[string]map[string]string{}}
	var b strings.Builder
	if err := g.structFields(&b, root, ""); err != nil {
		return "", err
	}
	return b.String(), nil
}

type gen struct {
	modulePath, moduleDir string
	// docs are field doc comments by package path, then "Type.Field".
	docs map[string]map[string]string
}

// structFields writes the keys of struct t, each prefixed with prefix
// (the parent keys, as "pool." or "workers[]."), and below each struct
// key its own.
func (g *gen) structFields(b *strings.Builder, t reflect.Type, prefix string) error {
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, inline := yamlName(f)
		if name == "-" {
			continue
		}
		if inline {
			if err := g.structFields(b, indirect(f.Type), prefix); err != nil {
				return err
			}
			continue
		}
		doc, err := g.doc(t, f.Name)
		if err != nil {
			return err
		}
		key := prefix + name
		fmt.Fprintf(b, "- `%s` (%s)", key, typeName(f.Type))
		if doc != "" {
			fmt.Fprintf(b, ": %s", doc)
		}
		b.WriteString("\n")
		switch ft := indirect(f.Type); {
		case ft.Kind() == reflect.Struct && ft != reflect.TypeFor[time.Time]():
			if err := g.structFields(b, ft, key+"."); err != nil {
				return err
			}
		case (ft.Kind() == reflect.Slice || ft.Kind() == reflect.Map) && indirect(ft.Elem()).Kind() == reflect.Struct:
			sep := "[]."
			if ft.Kind() == reflect.Map {
				sep = ".NAME."
			}
			if err := g.structFields(b, indirect(ft.Elem()), key+sep); err != nil {
				return err
			}
		}
	}
	return nil
}

// yamlName returns the field's YAML key (the lower-cased Go name when the
// tag names none, as yaml.v3 does) and whether it is inline.
func yamlName(f reflect.StructField) (string, bool) {
	tag := f.Tag.Get("yaml")
	name, opts, _ := strings.Cut(tag, ",")
	inline := strings.Contains(","+opts+",", ",inline,")
	if name == "" {
		name = strings.ToLower(f.Name)
	}
	return name, inline
}

func indirect(t reflect.Type) reflect.Type {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return t
}

// typeName says what a value of t is written as.
func typeName(t reflect.Type) string {
	t = indirect(t)
	switch {
	case t == reflect.TypeFor[time.Duration]():
		return "duration"
	case t.Kind() == reflect.Slice:
		return "list of " + typeName(t.Elem())
	case t.Kind() == reflect.Map:
		return "map of " + typeName(t.Elem())
	case t.Kind() == reflect.Struct:
		return "mapping"
	case t.Kind() == reflect.Bool:
		return "bool"
	case t.Kind() == reflect.String:
		return "string"
	case t.Kind() >= reflect.Int && t.Kind() <= reflect.Uint64:
		return "integer"
	case t.Kind() == reflect.Float32 || t.Kind() == reflect.Float64:
		return "number"
	}
	return t.Kind().String()
}

// doc returns the doc comment of field name of struct t, on one line.
func (g *gen) doc(t reflect.Type, name string) (string, error) {
	pkg := t.PkgPath()
	docs, ok := g.docs[pkg]
	if !ok {
		var err error
		if docs, err = g.parse(pkg); err != nil {
			return "", err
		}
		g.docs[pkg] = docs
	}
	return docs[t.Name()+"."+name], nil
}

// parse reads the doc comments of every struct field declared in the
// package at path pkg.
func (g *gen) parse(pkg string) (map[string]string, error) {
	rel, ok := strings.CutPrefix(pkg, g.modulePath)
	if !ok {
		return nil, fmt.Errorf("package %s is outside module %s", pkg, g.modulePath)
	}
	dir := filepath.Join(g.moduleDir, filepath.FromSlash(strings.TrimPrefix(rel, "/")))
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	docs := map[string]string{}
	fset := token.NewFileSet()
	for _, e := range entries {
		n := e.Name()
		if e.IsDir() || !strings.HasSuffix(n, ".go") || strings.HasSuffix(n, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, filepath.Join(dir, n), nil, parser.ParseComments|parser.SkipObjectResolution)
		if err != nil {
			return nil, err
		}
		ast.Inspect(f, func(node ast.Node) bool {
			ts, ok := node.(*ast.TypeSpec)
			if !ok {
				return true
			}
			st, ok := ts.Type.(*ast.StructType)
			if !ok {
				return true
			}
			for _, fl := range st.Fields.List {
				text := strings.Join(strings.Fields(fl.Doc.Text()), " ")
				if text == "" {
					text = strings.Join(strings.Fields(fl.Comment.Text()), " ")
				}
				for _, id := range fl.Names {
					docs[ts.Name.Name+"."+id.Name] = text
				}
			}
			return true
		})
	}
	return docs, nil
}
