//! The agents' data-plane frame decoder: length-delimited frames read back to back from one
//! connection (with a small job bound, so the bound check is exercised), each decoded as the
//! read loop does. A decoded message must re-encode to bytes that decode to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use proteus_agent::transport::{Dec, Enc, Frame, Request, Response, decode_frame, read_frame};
use std::sync::OnceLock;

static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();

fn reencode<T>(first: &T, encode: impl Fn(&T, &mut Enc), decode: impl Fn(&mut Dec) -> Option<T>) {
    let mut a = Enc::default();
    encode(first, &mut a);
    let again = decode(&mut Dec(&a.0)).expect("a re-encoded message does not decode");
    let mut b = Enc::default();
    encode(&again, &mut b);
    assert_eq!(a.0, b.0, "encoding is not stable across a round trip");
}

fn body(bytes: &[u8]) {
    match decode_frame(bytes) {
        Ok(Frame::Request { req: Ok(req), .. }) => {
            reencode(&req, |r, e| r.encode(e), |d| Request::decode(d).ok());
        }
        Ok(Frame::Response { resp: Ok(resp), .. }) => {
            reencode(&resp, |r, e| r.encode(e), |d| Response::decode(d).ok());
        }
        _ => {}
    }
}

fuzz_target!(|data: &[u8]| {
    let rt = RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
    });
    let mut stream = data;
    rt.block_on(async {
        while let Ok(frame) = read_frame(&mut stream, None, 1 << 16).await {
            body(&frame);
        }
    });
});
