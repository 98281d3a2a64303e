"""Tests of .ci/structure.py on small synthetic trees: each rule catches what it should, a clean tree passes.

    python3 .ci/test_structure.py      (or: python3 .ci/structure.py --self-test)
"""

import io
import os
import sys
import tempfile
import textwrap
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import structure  # noqa: E402

# A small crate laid out as APEX is: the layers, a re-export in a mod.rs, a child using its parent, tests.
CLEAN = {
    "lib.rs": """
        mod api;
        pub mod gpfifo;
        pub mod hw;
        pub mod launch;
        pub mod module;
        pub mod pushbuf;
        pub mod rm;
        pub use api::Gpu;
    """,
    "hw/mod.rs": "pub struct Field;\n",
    "rm/mod.rs": """
        mod error;
        mod gpu;
        pub use error::{Error, Result};
        pub use gpu::GpuCore;
    """,
    "rm/error.rs": "pub enum Error { Io }\npub type Result<T> = std::result::Result<T, Error>;\n",
    "rm/gpu.rs": """
        use super::{Error, Result};
        use crate::hw::Field;
        pub struct GpuCore(Field);
        impl GpuCore { pub fn open() -> Result<GpuCore> { Err(Error::Io) } }
    """,
    "gpfifo/mod.rs": "mod channel;\npub use channel::Channel;\n",
    "gpfifo/channel.rs": """
        // use crate::launch::Queue;  (a comment: not an edge)
        const S: &str = "crate::pushbuf::Queue";
        pub struct Channel(crate::rm::GpuCore);
    """,
    "pushbuf/mod.rs": "pub struct Queue(pub crate::gpfifo::Channel);\n",
    "module/mod.rs": "pub(crate) use crate::rm::{self, GpuCore as Core};\npub struct Module;\n",
    "launch/mod.rs": """
        mod queue;
        pub use queue::ComputeQueue;
        #[cfg(test)]
        mod tests;
    """,
    "launch/queue.rs": """
        use crate::{module::Module, pushbuf::{self, Queue}};
        pub struct ComputeQueue(Queue, Module);
        impl ComputeQueue {
            fn f(&self) -> Option<crate::rm::Error> { let _ = '"'; let _ = '\\''; None }
        }
        #[cfg(test)]
        mod tests {
            use crate::api::Gpu; // tests may reach any layer
        }
    """,
    "launch/tests.rs": "use crate::api::Gpu;\n",
    "api/mod.rs": "mod gpu;\nmod error;\npub use gpu::Gpu;\npub use error::Error;\n",
    "api/error.rs": "pub enum Error { Launch }\n",
    "api/gpu.rs": """
        use super::Error;
        pub struct Gpu(crate::launch::ComputeQueue);
        fn e() -> Error { Error::Launch }
    """,
}


def write(tree, root):
    for rel, text in tree.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(textwrap.dedent(text).lstrip("\n"))


def run(tree):
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "src")
        write(tree, src)
        return structure.check(src, out=io.StringIO())


def edges(tree):
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "src")
        write(tree, src)
        crate = structure.Crate(structure.load(src))
        return {(structure.name(a), structure.name(b)) for a, b in crate.edges()}


def changed(**files):
    tree = dict(CLEAN)
    tree.update(files)
    return tree


class CleanTree(unittest.TestCase):
    def test_passes(self):
        self.assertEqual(run(CLEAN), [])

    def test_edges_resolved(self):
        e = edges(CLEAN)
        # A re-export followed to where the item lives; a child's use of its parent left out.
        self.assertIn(("rm::gpu", "rm::error"), e)
        self.assertIn(("launch::queue", "pushbuf"), e)
        self.assertIn(("launch::queue", "module"), e)
        self.assertIn(("launch::queue", "rm::error"), e)  # crate::rm::Error in a signature
        self.assertIn(("gpfifo::channel", "rm::gpu"), e)
        self.assertIn(("api::gpu", "api::error"), e)
        self.assertIn(("module", "rm::gpu"), e)  # pub(crate) use, a renamed item in a group
        self.assertNotIn(("gpfifo::channel", "launch"), e)  # in a comment
        self.assertNotIn(("gpfifo::channel", "pushbuf"), e)  # in a string
        self.assertNotIn(("launch::queue", "api::gpu"), e)  # #[cfg(test)] block
        self.assertNotIn(("launch::tests", "api::gpu"), e)  # a file declared under #[cfg(test)]
        self.assertFalse(any(a == "rm::gpu" and b == "rm" for a, b in e))

    def test_the_real_tree_parses(self):
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
        if os.path.isdir(src):
            crate = structure.Crate(structure.load(src))
            self.assertGreater(len(crate.edges()), 100)


class LongFiles(unittest.TestCase):
    def test_long_file_fails(self):
        long = "pub fn f() {}\n" * (structure.MAX_LINES + 1)
        problems = run(changed(**{"hw/mod.rs": "pub struct Field;\n" + long}))
        self.assertEqual(len(problems), 1)
        self.assertIn("long file: src/hw/mod.rs has 1002 lines", problems[0])

    def test_at_the_limit_passes(self):
        text = "pub struct Field;\n" + "pub fn f() {}\n" * (structure.MAX_LINES - 1)
        self.assertEqual(run(changed(**{"hw/mod.rs": text})), [])

    def test_generated_file_exempt(self):
        long = "pub const X: u32 = 1;\n" * (structure.MAX_LINES + 1)
        tree = changed(
            **{
                "hw/mod.rs": "mod gen;\npub struct Field;\n",
                "hw/gen.rs": "// Generated by build/x.rs. Do not edit.\n" + long,
                "hw/gen2.rs": "/* automatically generated by rust-bindgen 0.73.2 */\n" + long,
            }
        )
        self.assertEqual(run(tree), [])


class Circles(unittest.TestCase):
    def test_circle_between_siblings(self):
        tree = changed(
            **{
                "rm/error.rs": "use super::gpu::GpuCore;\npub enum Error { Gpu(GpuCore) }\n"
                "pub type Result<T> = std::result::Result<T, Error>;\n"
            }
        )
        problems = run(tree)
        self.assertEqual(len(problems), 1, problems)
        p = problems[0]
        self.assertIn("import circle between modules rm::error (src/rm/error.rs), rm::gpu (src/rm/gpu.rs)", p)
        self.assertIn("src/rm/error.rs:1: use super::gpu::GpuCore;", p)
        self.assertIn("src/rm/gpu.rs:1: use super::{Error, Result};", p)

    def test_circle_through_a_reexport_and_a_code_path(self):
        # gpu -> error through rm/mod.rs's re-export; error -> gpu through a path in code.
        tree = changed(
            **{
                "rm/error.rs": "pub enum Error { Io(super::GpuCore) }\n"
                "pub type Result<T> = std::result::Result<T, Error>;\n"
            }
        )
        problems = run(tree)
        self.assertEqual(len(problems), 1, problems)
        self.assertIn("src/rm/error.rs:1: pub enum Error { Io(super::GpuCore) }", problems[0])

    def test_circle_through_a_glob(self):
        # `use super::*` brings rm/mod.rs's re-export of GpuCore: error -> gpu; gpu -> error closes the circle.
        # A method of the same name as something the parent imports (`x.open()`) is no edge.
        glob_user = "use super::*;\npub enum Error { Io }\npub type Result<T> = std::result::Result<T, Error>;\n"
        tree = changed(
            **{
                "rm/mod.rs": CLEAN["rm/mod.rs"].replace("GpuCore;", "{GpuCore, open};"),
                "rm/gpu.rs": CLEAN["rm/gpu.rs"] + "pub fn open() {}\n",
                "rm/error.rs": glob_user + "fn f(x: &u8) { x.open(); }\n",
            }
        )
        self.assertEqual(run(tree), [])
        tree["rm/error.rs"] = glob_user + "fn g(_: &GpuCore) {}\n"
        problems = run(tree)
        self.assertEqual(len(problems), 1, problems)
        self.assertIn("src/rm/error.rs:4: fn g(_: &GpuCore) {}", problems[0])

    def test_circle_of_three(self):
        tree = changed(
            **{
                "api/mod.rs": "mod a;\nmod b;\nmod c;\n" + CLEAN["api/mod.rs"],
                "api/a.rs": "use super::b::B;\npub struct A;\n",
                "api/b.rs": "pub struct B(crate::api::c::C);\n",
                "api/c.rs": "pub(crate) use self::inner::C;\nmod inner { pub struct C(super::super::a::A); }\n",
            }
        )
        problems = run(tree)
        self.assertEqual(len(problems), 1, problems)
        self.assertIn("api::a (src/api/a.rs), api::b (src/api/b.rs), api::c (src/api/c.rs)", problems[0])

    def test_test_code_is_not_a_circle(self):
        tree = changed(
            **{
                "rm/error.rs": CLEAN["rm/error.rs"] + "#[cfg(test)]\nmod tests { use super::super::gpu::GpuCore; }\n"
            }
        )
        self.assertEqual(run(tree), [])

    def test_circle_between_top_level_modules(self):
        # sim is allowed to use rm, but rm using sim closes a circle (and breaks the layers).
        tree = changed(
            **{
                "lib.rs": CLEAN["lib.rs"] + "pub mod sim;\n",
                "sim/mod.rs": "pub struct Frontend(crate::rm::GpuCore);\n",
                "rm/gpu.rs": CLEAN["rm/gpu.rs"] + "fn sim(_: &crate::sim::Frontend) {}\n",
            }
        )
        problems = run(tree)
        self.assertTrue(any(p.startswith("import circle between the top-level modules rm, sim") for p in problems))
        self.assertTrue(any(p.startswith("layer: rm uses sim") for p in problems), problems)


class Layers(unittest.TestCase):
    def test_layer_break_alone(self):
        # gpfifo may not use module (beside it, not below): no circle, only the layer rule catches it.
        tree = changed(**{"gpfifo/channel.rs": CLEAN["gpfifo/channel.rs"] + "use crate::module::Module;\n"})
        problems = run(tree)
        self.assertEqual(len(problems), 1, problems)
        self.assertIn("layer: gpfifo uses module", problems[0])
        self.assertIn("src/gpfifo/channel.rs:4: use crate::module::Module;", problems[0])

    def test_lower_layer_using_a_higher_one(self):
        tree = changed(**{"rm/gpu.rs": CLEAN["rm/gpu.rs"] + "use crate::pushbuf::Queue;\n"})
        problems = run(tree)
        layer = [p for p in problems if p.startswith("layer:")]
        self.assertEqual(len(layer), 1, problems)
        self.assertIn("layer: rm uses pushbuf", layer[0])
        self.assertIn("src/rm/gpu.rs:5: use crate::pushbuf::Queue;", layer[0])
        # ... which also closes circles: rm::gpu -> pushbuf -> gpfifo::channel -> rm::gpu.
        self.assertTrue(any(p.startswith("import circle between modules gpfifo::channel") for p in problems))
        top = "import circle between the top-level modules gpfifo, pushbuf, rm"
        self.assertTrue(any(p.startswith(top) for p in problems))

    def test_module_using_launch_in_a_group(self):
        tree = changed(**{"module/mod.rs": "use crate::{launch::{ComputeQueue}, rm};\npub struct Module;\n"})
        problems = run(tree)
        self.assertTrue(any(p.startswith("layer: module uses launch") for p in problems), problems)
        top = "import circle between the top-level modules launch, module"
        self.assertTrue(any(p.startswith(top) for p in problems))

    def test_launch_using_the_api_through_a_root_reexport(self):
        tree = changed(**{"launch/queue.rs": CLEAN["launch/queue.rs"] + "fn g(_: crate::Gpu) {}\n"})
        problems = run(tree)
        self.assertTrue(any(p.startswith("layer: launch uses api") for p in problems), problems)

    def test_test_code_may_reach_up(self):
        tree = changed(**{"rm/gpu.rs": CLEAN["rm/gpu.rs"] + "#[cfg(test)]\nuse crate::launch::ComputeQueue;\n"})
        self.assertEqual(run(tree), [])

    def test_unknown_top_level_module(self):
        tree = changed(**{"lib.rs": CLEAN["lib.rs"] + "mod extra;\n", "extra.rs": "pub struct X;\n"})
        problems = run(tree)
        self.assertTrue(any("extra is not in" in p for p in problems), problems)


class Lexing(unittest.TestCase):
    def test_strip_keeps_lines_and_blanks_literals(self):
        text = 'a /* x\n/* nested */ y */ b "s\\"t\nr" r#"raw"# \'c\' \'\\n\' &\'a str // end\nz'
        out = structure.strip(text)
        self.assertEqual(len(out), len(text))
        self.assertEqual(out.count("\n"), text.count("\n"))
        for gone in ("x", "nested", "raw", "end", "s\\"):
            self.assertNotIn(gone, out.replace("'a", ""))
        self.assertIn("'a str", out)
        self.assertTrue(out.rstrip().endswith("z"))

    def test_use_tree(self):
        toks = structure.tokens("crate::{a::{b, c as d}, e::{self, *}, f}")
        got = structure.parse_use_tree(toks)
        self.assertEqual(
            got,
            [
                (["crate", "a", "b"], "b", False),
                (["crate", "a", "c"], "d", False),
                (["crate", "e"], "e", False),
                (["crate", "e"], None, True),
                (["crate", "f"], "f", False),
            ],
        )


if __name__ == "__main__":
    unittest.main()
