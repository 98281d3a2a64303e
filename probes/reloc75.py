"""Finds how R_CUDA_ABS55_16_34 (type 75, in nvcc -G code) encodes its address: flips each bit of a relocated
instruction and asks nvdisasm what it now says. Run on the GPU machine: python3 probes/reloc75.py CUBIN"""
import struct, subprocess, sys, re, os, tempfile
b = open(sys.argv[1], 'rb').read()
shoff = struct.unpack_from('<Q', b, 0x28)[0]; shnum = struct.unpack_from('<H', b, 0x3c)[0]; shstr = struct.unpack_from('<H', b, 0x3e)[0]
secs = [struct.unpack_from('<IIQQQQIIQQ', b, shoff + i * 64) for i in range(shnum)]
so = secs[shstr][4]
name = lambda s: b[so + s[0]:b.index(b'\0', so + s[0])].decode()
for s in secs:
    if s[1] == 4:  # RELA
        tgt = secs[s[7]]
        for i in range(s[5] // 24):
            off, info, add = struct.unpack_from('<QQq', b, s[4] + i * 24)
            if info & 0xffffffff == 75:
                ins = b[tgt[4] + off: tgt[4] + off + 16]
                print(name(s), hex(off), 'addend', add, 'insn', ins.hex())
                def dis(raw):
                    with tempfile.NamedTemporaryFile(suffix='.bin', delete=False) as f:
                        f.write(raw)
                    out = subprocess.run(['nvdisasm', '-b', 'SM90', f.name], capture_output=True, text=True).stdout
                    os.unlink(f.name)
                    return ' '.join(l.split('*/')[-1].strip() for l in out.splitlines() if '/*0000*/' in l)
                print(' base:', dis(ins))
                for bit in range(128):
                    raw = bytearray(ins); raw[bit // 8] ^= 1 << (bit % 8)
                    print(f' bit {bit}: {dis(bytes(raw))}')
                sys.exit(0)
