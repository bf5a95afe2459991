//! The stage table, character for character as Megatron-LM's
//! `PipelineParallelLayerLayout.pretty_repr` prints it: one row per pp rank (identical
//! consecutive rows merged as `PP rank 1-13`), one column per virtual stage, each cell the
//! run-length form of the stage (`embedding,decoder*3`), columns padded to their widest cell
//! and separated by 8 spaces (4 when vpp > 4).

use super::Layout;

/// Megatron's cell: runs of equal layers as `word*n`, comma separated.
fn cell(stage: Option<&Vec<super::LayerKind>>) -> String {
    let Some(stage) = stage else {
        return "(no stage)".to_string();
    };
    if stage.is_empty() {
        return "(empty stage)".to_string();
    }
    let mut parts = Vec::new();
    let mut i = 0;
    while i < stage.len() {
        let k = stage[i];
        let run = stage[i..].iter().take_while(|&&x| x == k).count();
        parts.push(if run > 1 {
            format!("{}*{run}", k.word())
        } else {
            k.word().to_string()
        });
        i += run;
    }
    parts.join(",")
}

impl Layout {
    /// The stage table for `pp` ranks (stage `i` on rank `i % pp`, chunk `i / pp`), as
    /// Megatron's `pretty_repr` prints it, without a trailing newline. Meant for layouts that
    /// passed [`super::check_against`]; if `pp` does not divide the stage count the missing
    /// cells read `(no stage)`, and `pp = 0` gives an empty string.
    pub fn table(&self, pp: u32) -> String {
        if pp == 0 {
            return String::new();
        }
        let pp = pp as usize;
        let vpp = self.stages.len().div_ceil(pp).max(1);
        let mut matrix: Vec<Vec<String>> = Vec::with_capacity(pp + 1);
        if vpp > 1 {
            let mut header = vec![String::new()];
            header.extend((0..vpp).map(|v| format!("VPP rank {v}")));
            matrix.push(header);
        }
        let row = |r: usize| -> Vec<String> {
            (0..vpp)
                .map(|v| cell(self.stages.get(v * pp + r)))
                .collect()
        };
        let mut start = 0;
        let mut prev = row(0);
        for r in 1..=pp {
            let cur = if r < pp { row(r) } else { Vec::new() };
            if cur != prev {
                let label = if start == r - 1 {
                    format!("PP rank {start}")
                } else {
                    format!("PP rank {start}-{}", r - 1)
                };
                let mut line = vec![label];
                line.append(&mut prev);
                matrix.push(line);
                start = r;
                prev = cur;
            }
        }
        let cols = vpp + 1;
        let widths: Vec<usize> = (0..cols)
            .map(|c| {
                matrix
                    .iter()
                    .map(|row| row[c].chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let sep = " ".repeat(if vpp <= 4 { 8 } else { 4 });
        let lines: Vec<String> = matrix
            .iter()
            .map(|row| {
                row.iter()
                    .zip(&widths)
                    .map(|(s, &w)| format!("{s:<w$}"))
                    .collect::<Vec<_>>()
                    .join(&sep)
            })
            .collect();
        lines.join("\n")
    }
}

#[cfg(test)]
mod tests {
    use crate::layout::parse;

    #[test]
    fn megatron_docstring_table() {
        // The example in `pretty_repr`'s docstring (its first cell says decoder*2 where the
        // layout it describes, the documented "Et*3|(tt|)*29,m|L", has three decoders) and
        // without Megatron's trailing padding, which the docstring trims.
        let t = parse("Et*3|(tt|)*29,m|L").unwrap().table(16);
        let trimmed: Vec<&str> = t.lines().map(str::trim_end).collect();
        assert_eq!(
            trimmed,
            [
                "                    VPP rank 0                 VPP rank 1",
                "PP rank 0           embedding,decoder*3        decoder*2",
                "PP rank 1-13        decoder*2                  decoder*2",
                "PP rank 14          decoder*2                  mtp",
                "PP rank 15          decoder*2                  loss",
            ]
        );
    }

    #[test]
    fn single_chunk_has_no_header_and_narrow_gap_past_vpp_4() {
        let t = parse("E|t|L").unwrap().table(3);
        assert_eq!(
            t,
            "PP rank 0        embedding\nPP rank 1        decoder  \nPP rank 2        loss     "
        );
        // Five chunks: the gap narrows to 4 spaces. Widths: 9, 10, 13, 13, 13, 10.
        let t = parse("E|(|)*3L").unwrap().table(1);
        assert_eq!(
            t,
            [
                "             VPP rank 0    VPP rank 1       VPP rank 2       VPP rank 3       VPP rank 4",
                "PP rank 0    embedding     (empty stage)    (empty stage)    (empty stage)    loss      ",
            ]
            .join("\n")
        );
    }
}
