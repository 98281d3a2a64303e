use super::*;

const CFG: LaunchConfig = LaunchConfig {
    grid: [1, 1, 1],
    block: [1, 1, 1],
    shared_bytes: 0,
    cluster: None,
    sync_domain: 0,
    cluster_policy: crate::launch::ClusterPolicy::Default,
};

#[test]
fn programmatic_marks_launches_only_and_survives_kernel_mapping() {
    let mut g: Graph<u32> = Graph::new();
    let a = g.launch(1, CFG, Vec::new());
    let b = g.launch(2, CFG, Vec::new());
    let c = g.copy(0x1000, 0x2000, 64).unwrap();
    g.set_programmatic(b).unwrap();
    assert!(matches!(
        g.set_programmatic(c),
        Err(GraphError::NotALaunch(2))
    ));
    assert!(matches!(
        g.set_programmatic(NodeId(9)),
        Err(GraphError::NoSuchNode { node: 9, .. })
    ));
    let m = g
        .map_kernels(|k| Ok::<u64, ()>(u64::from(*k) * 10))
        .unwrap();
    let flags: Vec<bool> = m.nodes().iter().map(Node::is_programmatic).collect();
    assert_eq!(flags, vec![false, true, false]);
    assert!(!g.node(a).unwrap().is_programmatic());
}

/// A launch node of kernel `k` reading and writing the given ranges.
fn node(g: &mut Graph<u32>, k: u32, reads: &[(u64, u64)], writes: &[(u64, u64)]) -> NodeId {
    let id = g.launch(k, CFG, Vec::new());
    for &(va, len) in reads {
        g.read(id, Range::new(va, len).unwrap()).unwrap();
    }
    for &(va, len) in writes {
        g.write(id, Range::new(va, len).unwrap()).unwrap();
    }
    id
}

fn pairs(d: &Dependencies) -> Vec<(usize, usize)> {
    d.edges().iter().map(|e| (e.from.0, e.to.0)).collect()
}

#[test]
fn ranges_are_half_open() {
    let r = |va, len| Range::new(va, len).unwrap();
    assert!(r(0, 16).overlaps(&r(15, 1)));
    assert!(!r(0, 16).overlaps(&r(16, 16)), "adjacent ranges");
    assert!(!r(16, 16).overlaps(&r(0, 16)));
    assert!(r(0, 100).overlaps(&r(40, 2)), "containment");
    assert!(!r(8, 0).overlaps(&r(0, 100)), "an empty range");
    assert!(r(u64::MAX - 1, 1).overlaps(&r(u64::MAX - 2, 2)));
    assert_eq!(
        Range::new(u64::MAX, 2),
        Err(GraphError::RangeOverflow {
            va: u64::MAX,
            len: 2
        })
    );
}

#[test]
fn each_hazard_kind_orders_the_pair() {
    // Read after write.
    let mut g = Graph::new();
    let w = node(&mut g, 0, &[], &[(0x1000, 64)]);
    let r = node(&mut g, 1, &[(0x1000, 64)], &[(0x9000, 4)]);
    let d = g.dependencies().unwrap();
    let e = d.edge(w, r).expect("RAW edge");
    assert!(e.why.contains(Hazard::ReadAfterWrite));
    assert!(!e.why.contains(Hazard::WriteAfterRead));
    assert!(!e.why.contains(Hazard::WriteAfterWrite));
    // Write after read.
    let mut g = Graph::new();
    let r = node(&mut g, 0, &[(0x1000, 64)], &[]);
    let w = node(&mut g, 1, &[], &[(0x1000, 64)]);
    let e = *g.dependencies().unwrap().edge(r, w).expect("WAR edge");
    assert!(e.why.contains(Hazard::WriteAfterRead));
    assert!(!e.why.contains(Hazard::ReadAfterWrite));
    // Write after write.
    let mut g = Graph::new();
    let a = node(&mut g, 0, &[], &[(0x1000, 64)]);
    let b = node(&mut g, 1, &[], &[(0x1000, 64)]);
    let e = *g.dependencies().unwrap().edge(a, b).expect("WAW edge");
    assert_eq!(e.why, Hazards::default().with(Hazard::WriteAfterWrite));
    // Reads never conflict.
    let mut g = Graph::new();
    node(&mut g, 0, &[(0x1000, 64)], &[]);
    node(&mut g, 1, &[(0x1000, 64)], &[]);
    assert!(g.dependencies().unwrap().edges().is_empty());
    // A node that reads and writes a range: all three against another like it.
    let mut g = Graph::new();
    let a = node(&mut g, 0, &[(0, 8)], &[(0, 8)]);
    let b = node(&mut g, 1, &[(0, 8)], &[(0, 8)]);
    let why = g.dependencies().unwrap().edge(a, b).unwrap().why;
    for h in [
        Hazard::ReadAfterWrite,
        Hazard::WriteAfterRead,
        Hazard::WriteAfterWrite,
    ] {
        assert!(why.contains(h), "{h:?}");
    }
    assert!(!why.contains(Hazard::Explicit));
}

#[test]
fn partial_overlap_conflicts_and_disjoint_or_adjacent_do_not() {
    let mut g = Graph::new();
    let a = node(&mut g, 0, &[], &[(0x1000, 0x100)]);
    let b = node(&mut g, 1, &[(0x10ff, 0x100)], &[]); // one byte shared with a
    let c = node(&mut g, 2, &[(0x1100, 0x100)], &[]); // adjacent to a: no conflict
    let d = node(&mut g, 3, &[], &[(0x5000, 0x10)]); // disjoint from all
    let deps = g.dependencies().unwrap();
    assert_eq!(pairs(&deps), vec![(0, 1)]);
    assert!(deps.preds(c).is_empty() && deps.preds(d).is_empty());
    assert_eq!(deps.preds(b), &[a]);
    assert_eq!(deps.levels(), vec![0, 1, 0, 0]);
}

#[test]
fn many_readers_then_one_writer_fan_in() {
    let mut g = Graph::new();
    let w0 = node(&mut g, 0, &[], &[(0, 4096)]);
    let readers: Vec<NodeId> = (0..8)
        .map(|i| node(&mut g, 1, &[(0, 4096)], &[(0x10000 + i * 64, 64)]))
        .collect();
    let w1 = node(&mut g, 2, &[], &[(0, 4096)]);
    let d = g.dependencies().unwrap();
    // Every reader after the first writer; the second writer after every reader (WAR), and its WAW edge on
    // the first writer is implied by those paths, so it is dropped.
    for &r in &readers {
        assert_eq!(d.preds(r), &[w0]);
        assert!(d.edge(r, w1).unwrap().why.contains(Hazard::WriteAfterRead));
    }
    assert_eq!(d.preds(w1), readers.as_slice());
    assert!(d.edge(w0, w1).is_none(), "transitively implied");
    assert_eq!(d.edges().len(), 16);
    assert_eq!(d.levels()[w1.0], 2);
}

#[test]
fn chains_and_diamonds_are_reduced() {
    // A chain where every node reads and writes one buffer: only neighbours are joined.
    let mut g = Graph::new();
    for i in 0..50 {
        node(&mut g, i, &[(0, 8)], &[(0, 8)]);
    }
    let d = g.dependencies().unwrap();
    assert_eq!(pairs(&d), (0..49).map(|i| (i, i + 1)).collect::<Vec<_>>());
    // A diamond: a → {b, c} → d, with d also reading a's output (implied through b and c).
    let mut g = Graph::new();
    let a = node(&mut g, 0, &[], &[(0, 64)]);
    let b = node(&mut g, 1, &[(0, 64)], &[(0x100, 64)]);
    let c = node(&mut g, 2, &[(0, 64)], &[(0x200, 64)]);
    let dd = node(
        &mut g,
        3,
        &[(0, 64), (0x100, 64), (0x200, 64)],
        &[(0x300, 64)],
    );
    let d = g.dependencies().unwrap();
    assert_eq!(pairs(&d), vec![(0, 1), (0, 2), (1, 3), (2, 3)]);
    assert_eq!(d.preds(dd), &[b, c]);
    assert_eq!(d.succs(a), &[b, c]);
    assert_eq!(d.order(), &[a, b, c, dd]);
}

#[test]
fn explicit_edges_order_unrelated_nodes_and_may_point_backwards() {
    let mut g = Graph::new();
    let a = node(&mut g, 0, &[], &[(0, 8)]);
    let b = node(&mut g, 1, &[], &[(0x100, 8)]);
    let c = node(&mut g, 2, &[], &[(0x200, 8)]);
    g.edge(c, a).unwrap();
    g.edge(b, c).unwrap();
    g.edge(b, a).unwrap(); // implied by b → c → a
    let d = g.dependencies().unwrap();
    assert_eq!(pairs(&d), vec![(1, 2), (2, 0)]);
    assert_eq!(
        d.edge(c, a).unwrap().why,
        Hazards::default().with(Hazard::Explicit)
    );
    assert_eq!(d.order(), &[b, c, a]);
    // An explicit edge that duplicates a hazard carries both reasons.
    let mut g = Graph::new();
    let a = node(&mut g, 0, &[], &[(0, 8)]);
    let b = node(&mut g, 1, &[(0, 8)], &[]);
    g.edge(a, b).unwrap();
    let why = g.dependencies().unwrap().edge(a, b).unwrap().why;
    assert!(why.contains(Hazard::Explicit) && why.contains(Hazard::ReadAfterWrite));
}

#[test]
fn cycles_and_unknown_nodes_are_typed_errors() {
    let mut g = Graph::new();
    let a = node(&mut g, 0, &[], &[(0, 8)]);
    let b = node(&mut g, 1, &[(0, 8)], &[]); // a → b by RAW
    let c = node(&mut g, 2, &[], &[]);
    g.edge(b, c).unwrap();
    g.edge(c, a).unwrap();
    match g.dependencies() {
        Err(GraphError::Cycle { nodes }) => {
            let mut sorted = nodes.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, vec![0, 1, 2]);
            // Each node depends on the one before it, the first on the last.
            for w in 0..nodes.len() {
                let (from, to) = (nodes[w], nodes[(w + 1) % nodes.len()]);
                assert!([(0, 1), (1, 2), (2, 0)].contains(&(from, to)), "{nodes:?}");
            }
            let text = GraphError::Cycle { nodes }.to_string();
            assert!(text.contains("cycle") && text.contains("→"), "{text}");
        }
        other => panic!("expected a cycle, got {other:?}"),
    }
    assert_eq!(g.edge(a, a), Err(GraphError::Cycle { nodes: vec![0] }));
    let mut other: Graph<u32> = Graph::new();
    assert!(matches!(
        other.edge(a, b),
        Err(GraphError::NoSuchNode { node: 0, len: 0 })
    ));
    assert!(other.read(c, Range::new(0, 1).unwrap()).is_err());
    assert!(g.id(3).is_err());
    assert_eq!(g.id(2).unwrap(), c);
}

#[test]
fn empty_graphs_and_copies() {
    let g: Graph<u32> = Graph::new();
    let d = g.dependencies().unwrap();
    assert!(d.is_empty() && d.edges().is_empty() && d.order().is_empty());
    let mut g: Graph<u32> = Graph::new();
    let w = node(&mut g, 0, &[], &[(0x1000, 256)]);
    let c = g.copy(0x1000, 0x2000, 256).unwrap();
    let r = node(&mut g, 1, &[(0x20f0, 4)], &[]);
    let d = g.dependencies().unwrap();
    assert_eq!(pairs(&d), vec![(w.0, c.0), (c.0, r.0)]);
    assert!(g.copy(u64::MAX - 4, 0, 8).is_err());
    let mapped = g.map_kernels(|k| Ok::<_, ()>(u64::from(*k) + 7)).unwrap();
    assert_eq!(mapped.dependencies().unwrap(), d);
    assert!(matches!(
        mapped.node(w).unwrap().op(),
        Op::Launch { kernel: 7, .. }
    ));
}

/// xorshift64*: deterministic randomness for the property test.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Reachability by Floyd–Warshall over `edges`.
fn closure(n: usize, edges: &[(usize, usize)]) -> Vec<Vec<bool>> {
    let mut r = vec![vec![false; n]; n];
    for &(a, b) in edges {
        r[a][b] = true;
    }
    for k in 0..n {
        let via = r[k].clone();
        for row in r.iter_mut().filter(|row| row[k]) {
            for (cell, &v) in row.iter_mut().zip(&via) {
                *cell |= v;
            }
        }
    }
    r
}

#[test]
fn random_graphs_order_every_conflict_with_no_redundant_edge() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut cycles = 0;
    for _ in 0..2000 {
        let n = 1 + rng.below(12) as usize;
        let mut g: Graph<u32> = Graph::new();
        let range = |rng: &mut Rng| {
            let va = rng.below(64);
            Range::new(va, 1 + rng.below(12)).unwrap()
        };
        for k in 0..n {
            let id = g.launch(k as u32, CFG, Vec::new());
            for _ in 0..rng.below(3) {
                let r = range(&mut rng);
                g.read(id, r).unwrap();
            }
            for _ in 0..rng.below(3) {
                let r = range(&mut rng);
                g.write(id, r).unwrap();
            }
        }
        let mut required: Vec<(usize, usize)> = Vec::new();
        for j in 0..n {
            for i in 0..j {
                if !g.hazards(i, j).is_empty() {
                    required.push((i, j));
                }
            }
        }
        // Explicit edges, mostly forward; a backward one may close a cycle.
        for _ in 0..rng.below(4) {
            let (a, b) = (rng.below(n as u64) as usize, rng.below(n as u64) as usize);
            if a != b && (a < b || rng.below(4) == 0) {
                g.edge(NodeId(a), NodeId(b)).unwrap();
                required.push((a, b));
            }
        }
        let must = closure(n, &required);
        let acyclic = (0..n).all(|v| !must[v][v]);
        let d = match g.dependencies() {
            Ok(d) => d,
            Err(GraphError::Cycle { nodes }) => {
                assert!(!acyclic, "a cycle reported in an acyclic graph");
                for w in 0..nodes.len() {
                    let (a, b) = (nodes[w], nodes[(w + 1) % nodes.len()]);
                    assert!(must[a][b], "cycle edge {a} → {b} is not required");
                }
                cycles += 1;
                continue;
            }
            Err(e) => panic!("{e}"),
        };
        assert!(acyclic, "a cyclic graph was accepted");
        let kept = pairs(&d);
        let has = closure(n, &kept);
        for i in 0..n {
            for j in 0..n {
                // Every required ordering has a path, and the reduced graph orders nothing more.
                assert_eq!(has[i][j], must[i][j], "{i} → {j} in {kept:?}");
            }
        }
        // No edge is redundant: without it, its ends are no longer ordered.
        for (x, &(a, b)) in kept.iter().enumerate() {
            let rest: Vec<_> = kept
                .iter()
                .enumerate()
                .filter(|&(y, _)| y != x)
                .map(|(_, &e)| e)
                .collect();
            assert!(!closure(n, &rest)[a][b], "edge {a} → {b} is redundant");
        }
        // The order is topological.
        let mut pos = vec![0; n];
        for (p, v) in d.order().iter().enumerate() {
            pos[v.0] = p;
        }
        assert!(kept.iter().all(|&(a, b)| pos[a] < pos[b]));
    }
    assert!(cycles > 10, "the test should meet cycles too ({cycles})");
}
